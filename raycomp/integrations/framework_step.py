"""raycomp's part of a training step that a framework drives: Lightning or the Hugging Face
Trainer run the micro-batches, step the optimizer, update their GradScaler and zero the
gradients; raycomp judges the reduced gradient before that optimizer step and records the
step after it, through the two halves of :class:`~raycomp.train.TrainLoop`'s step.

The framework's order, and what raycomp does at each point:

1. every micro-batch's backward (:meth:`FrameworkStep.add`, :meth:`~FrameworkStep.add_samples`): the step's loss is the sum of
   the micro-batches' losses, which both frameworks divide by the number of micro-batches
   before backward. DDP runs the comm hook only in the last micro-batch's backward (the
   others run under ``no_sync``), so raycomp compresses the accumulated gradient once.
2. gradients complete, and unscaled where a GradScaler runs, just before the optimizer
   step (:meth:`FrameworkStep.before_optimizer_step`): ``loop.after_backward``, where the
   guard decides. When it skips the step every gradient is set to None: a torch optimizer
   steps no parameter without a gradient (``Optimizer.zero_grad(set_to_none=True)``'s
   documented behaviour), so the framework's ``optimizer.step()`` (its GradScaler's
   ``step`` included) changes no weight and no optimizer state.
3. after the optimizer step (:meth:`FrameworkStep.after_optimizer_step`):
   ``loop.after_optimizer_step``: the gradient strategy's after-step work (where a local-step
   sync merges the ranks' weights), statistics, the step log and the control boundary.

The loop is started with ``owns_optimizer=False`` and no scheduler: the framework zeroes
the gradients, updates its scaler and steps its scheduler itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raycomp._internal.train.ddp_strategy import ddp_hook_strategy
from raycomp.train import TrainLoop, TrainOptions
from raycomp.train.gradient_strategy import GradientStrategy, StrategySetup

__all__ = ["LOGGED", "FrameworkStep", "batch_size", "framework_strategy", "refuse_unsupported"]

#: what the integrations log through the framework's own logging (:meth:`FrameworkStep.logged`)
LOGGED = ("raycomp/compression_ratio", "raycomp/plan_version", "raycomp/fallback_active", "raycomp/fallbacks")

log = logging.getLogger("raycomp.train")


class FrameworkStep:
    """One worker's glue between a framework's step and its :class:`~raycomp.train.TrainLoop`."""

    def __init__(self, loop: TrainLoop) -> None:
        self.loop = loop
        self._loss: torch.Tensor | None = None  # the step's loss so far, on the device (no host sync)
        self._samples = 0
        self._applied: bool | None = None  # the guard's verdict, between the two halves
        self._checkpoint_pending = False
        self._warned = False

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, as the framework divided it for accumulation."""
        loss = loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss

    def add_samples(self, samples: int) -> None:
        """A micro-batch's number of samples on this rank (for samples/s)."""
        self._samples += samples

    def before_optimizer_step(self) -> bool:
        """The guard's verdict on the complete gradient; on a skip every gradient is set to
        None so the framework's optimizer step applies nothing. Returns whether it applies."""
        if self._checkpoint_pending:  # a checkpoint was saved (and reported) since the last step
            self.wait_for_checkpoint()
        if self._loss is None and not self._warned:
            self._warned = True
            log.warning("raycomp saw no loss for step %d (a backward that bypassed the framework's): "
                        "the guard judges the gradients only", self.loop.global_step)
        self._applied = self.loop.after_backward(0.0 if self._loss is None else self._loss)
        if not self._applied:
            self.loop.optimizer.zero_grad(set_to_none=True)
        return self._applied

    def after_optimizer_step(self) -> None:
        """After the framework's optimizer step: statistics, step log, control boundary.
        Nothing when no verdict was taken since the last call (no optimizer step ran)."""
        if self._applied is None:
            return
        applied, samples = self._applied, self._samples
        self._applied, self._loss, self._samples = None, None, 0
        self.loop.after_optimizer_step(None, samples, applied)  # the loss after_backward took

    def logged(self) -> dict[str, float | int]:
        """raycomp's values for the framework's own logging (Lightning's ``self.log``, the
        Trainer's ``log``), so they sit beside the loss in its loggers: the run's compression
        ratio so far on this rank (dense / wire bytes; 1.0 before any byte is sent or with
        one worker, as ``ray.train.report`` has it), the version of the plan in force, 1.0
        while the guard's dense fallback is on, and the fallbacks so far."""
        guard = self.loop.judge.guard
        ratio = self.loop.state.ledger.compression_ratio
        return dict(zip(LOGGED, (float(ratio or 1.0), int(self.loop.state.plan.version), float(guard.active),
                                 sum(e.kind == "fallback" for e in guard.events)), strict=True))

    def checkpoint_saved(self) -> None:
        """A checkpoint holding raycomp's state was written; the framework's callback
        reports it to Ray Train after this. Before the next step, :meth:`wait_for_checkpoint`."""
        self._checkpoint_pending = True

    def wait_for_checkpoint(self) -> None:
        """Block until Ray Train has registered every reported checkpoint: it does so
        asynchronously, and a worker that died before that would restart from an older one."""
        import ray.train

        self._checkpoint_pending = False
        ray.train.get_all_reported_checkpoints()


def framework_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> GradientStrategy:
    """The integrations' default ``gradient_strategy``: raycomp's hook on the DDP model the
    framework built (:func:`raycomp._internal.train.ddp_strategy.ddp_hook_strategy`), or with
    ``compression.local.mode`` fixed or auto, local steps over it while the plan says so
    (:func:`raycomp._internal.train.local_strategy.local_hook_strategy`).

    The one place where a framework-driven run picks how its gradients travel, as
    :func:`raycomp._internal.train.default_strategy.raycomp_strategy` is for ``prepare_model``. A strategy gets the
    framework's DDP model before its first backward, and its
    ``after_optimizer_step(applied, loss)`` runs once per optimizer step, after the
    framework's."""
    if setup.options.compression.local.mode != "off":
        from raycomp._internal.train.local_strategy import local_hook_strategy

        return local_hook_strategy(model, optimizer, setup)
    return ddp_hook_strategy(model, optimizer, setup)


def refuse_unsupported(options: TrainOptions, where: str) -> None:
    """A one-line ValueError for options that a framework-driven step cannot honour."""
    if options.strategy != "ddp":
        raise ValueError(f"strategy: {where} runs on the framework's DDP model; allowed: 'ddp', "
                         f"got {options.strategy!r}")
    if options.checkpoint.every_steps is not None:
        raise ValueError(f"checkpoint.every_steps: {where} checkpoints through the framework's own "
                         f"checkpoints (raycomp's state is saved beside them); allowed: None, "
                         f"got {options.checkpoint.every_steps!r}")
    if options.compression.lr_scaling.enabled:
        raise ValueError(f"compression.lr_scaling.enabled: the framework steps the optimizer and its "
                         f"learning rate under {where}; allowed: False")


def batch_size(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor (in a
    tensor, a sequence or a mapping of them); 0 when it holds no tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        for item in batch:
            size = batch_size(item)
            if size:
                return size
    return 0
