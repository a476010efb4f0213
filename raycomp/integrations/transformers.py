"""raycomp in the Hugging Face Trainer on Ray Train.

A Trainer script on Ray Train changes one line (and the driver adds the controller)::

    from ray.train.huggingface.transformers import RayTrainReportCallback
    from raycomp.integrations.transformers import prepare_trainer

    def train_func(config):
        trainer = transformers.Trainer(model=model, args=TrainingArguments(..., bf16=True,
                                       gradient_accumulation_steps=2), train_dataset=...,
                                       callbacks=[RayTrainReportCallback()])
        trainer = prepare_trainer(trainer, raycomp.train.TrainOptions(...))  # was Ray's prepare_trainer
        trainer.train(resume_from_checkpoint=...)   # from ray.train.get_checkpoint(), as before

    TorchTrainer(train_func, ..., run_config=RunConfig(callbacks=[raycomp.train.ControllerCallback()]))

accelerate builds the Trainer's DDP model and takes only torch's built-in comm hooks, so
raycomp comes in through a callback that holds the trainer (:class:`RaycompCallback`):

* before that, unless ``TrainingArguments(ddp_bucket_cap_mb=...)`` says otherwise, it gives
  accelerate raycomp's bucket cap (``compression.bucket_cap_mb``: about 8 buckets), so the
  compressed buckets overlap backward;
* at ``on_train_begin``, once accelerate has wrapped the model in DDP and built the
  optimizer (and, for fp16 on a GPU, its GradScaler), it registers raycomp's hook on that
  DDP model and starts the :class:`~raycomp.train.TrainLoop` (controller link, plan sync,
  guard, statistics, step logs), told the scaler so error feedback follows the loss scale;
* it follows the Trainer's step (:class:`~raycomp.integrations.framework_step.FrameworkStep`):
  each micro-batch's loss from ``training_step``, the guard's verdict in
  ``on_pre_optimizer_step``, the step's record in ``on_step_end``;
* at ``on_save`` every rank writes raycomp's state into the checkpoint the Trainer just
  saved (``checkpoint-<step>/raycomp/rank<r>.pt``) and waits for the other ranks, so that
  Ray's ``RayTrainReportCallback``, which copies that directory in its own ``on_save``,
  finds all of it; ``train(resume_from_checkpoint=...)`` reads this rank's file back;
* at ``on_train_end``, totals over all ranks (``trainer.raycomp.totals``) and ``summary.json``;
* every entry the Trainer logs while training (``trainer.state.log_history`` and the
  ``report_to`` integrations) gets the compression ratio, the plan version and the guard's
  fallbacks (``raycomp/compression_ratio``, ``raycomp/plan_version``,
  ``raycomp/fallback_active``, ``raycomp/fallbacks``).

:func:`prepare_trainer` applies Ray's ``prepare_trainer`` (Ray Data), then, as Ray's does,
gives the trainer a subclass of its own class: it overrides ``training_step`` (to read each
micro-batch's loss, which no callback sees), ``log`` (a callback's ``on_log`` comes after
the entry is in ``log_history``) and ``train`` (to learn where it resumes from).

The guard judges the gradient the Trainer hands to the optimizer: with ``max_grad_norm > 0``
(the Trainer's default, 1.0) that is the clipped gradient, so non-finite gradients, loss
spikes and compression error make it fall back, while an exploding norm is already clipped
by the Trainer. Only DDP: DeepSpeed and FSDP wrap the model otherwise.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from raycomp._internal.ddp.buckets import ddp_kwargs
from raycomp.integrations import state_files
from raycomp.integrations.framework_step import (
    FrameworkStep,
    batch_size,
    framework_strategy,
    refuse_unsupported,
)
from raycomp.train import TrainLoop, TrainOptions, finish_loop, start_loop
from raycomp.train.gradient_strategy import GradientStrategyFactory

__all__ = ["STATE_DIR", "RaycompCallback", "prepare_trainer"]

#: raycomp's directory inside each of the Trainer's checkpoint directories
STATE_DIR = "raycomp"


def prepare_trainer(trainer: Trainer, options: TrainOptions | None = None, *, monitor: str | None = None,
                    gradient_strategy: GradientStrategyFactory = framework_strategy) -> Trainer:
    """Ray's ``ray.train.huggingface.transformers.prepare_trainer`` with raycomp's adaptive
    compression (see the module); returns the trainer, whose ``raycomp`` attribute is its
    :class:`RaycompCallback`.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass) built in the training function.
        options: raycomp's options (:class:`~raycomp.train.TrainOptions`). Not available here:
            ``strategy="fsdp"``, ``checkpoint.every_steps`` (checkpoints are the Trainer's,
            ``save_strategy``) and ``compression.lr_scaling`` (the Trainer steps the optimizer).
        monitor: an evaluation metric as the Trainer names it (``"eval_loss"``); after each
            evaluation its value goes to the controller, read as ``options.eval_kind`` says.
        gradient_strategy: how gradients travel, ``factory(ddp_model, optimizer, setup)``
            (:mod:`raycomp.train.gradient_strategy`); it gets accelerate's DDP model and must
            return it as its ``model``.
    """
    from ray.train.huggingface.transformers import prepare_trainer as ray_prepare_trainer

    options = options or TrainOptions()
    refuse_unsupported(options, "raycomp's prepare_trainer")
    if not isinstance(trainer, Trainer):
        raise ValueError(f"trainer: a transformers.Trainer, got {type(trainer).__name__}")
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError("trainer.args: raycomp compresses the Trainer's DDP gradients; allowed: "
                         "neither deepspeed nor fsdp")
    if isinstance(trainer, _RaycompTrainer):
        raise ValueError("trainer: raycomp's prepare_trainer was applied to it already")
    handler = trainer.accelerator.ddp_handler  # the DDP options accelerate will build with
    if handler is not None and trainer.args.ddp_bucket_cap_mb is None:
        handler.bucket_cap_mb = ddp_kwargs(options.compression, trainer.model).get("bucket_cap_mb", 25)
    trainer = ray_prepare_trainer(trainer)
    trainer.__class__ = _with_raycomp(type(trainer))
    trainer.raycomp = RaycompCallback(trainer, options, monitor, gradient_strategy)
    # first: its on_save must write raycomp's files before RayTrainReportCallback copies the checkpoint
    trainer.callback_handler.callbacks.insert(0, trainer.raycomp)
    return trainer


class _RaycompTrainer(Trainer):
    """What :func:`prepare_trainer` adds to the trainer's own class."""

    raycomp: RaycompCallback

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.raycomp.add(loss, batch_size(inputs))
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Every log entry (``state.log_history``, the ``report_to`` integrations) with
        raycomp's values (:meth:`RaycompCallback.add_logged`)."""
        self.raycomp.add_logged(logs)
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None) -> Any:
        if resume_from_checkpoint is True:  # the Trainer's own meaning: the last one in output_dir
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self.raycomp.resume_from = Path(resume_from_checkpoint) if resume_from_checkpoint else None
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            self.raycomp.close()


@functools.cache
def _with_raycomp(base: type) -> type:
    """``base`` (the trainer's class, Ray's subclass of it) with :class:`_RaycompTrainer`'s methods."""
    return type(f"Raycomp{base.__name__}", (_RaycompTrainer, base), {})


class RaycompCallback(TrainerCallback):
    """raycomp's hooks into the Trainer's loop; :func:`prepare_trainer` builds it.

    Attributes:
        loop: the worker's :class:`~raycomp.train.TrainLoop`, from ``on_train_begin``.
        totals: run totals over all ranks once training ended (``raycomp.train.finish``'s).
    """

    def __init__(self, trainer: Trainer, options: TrainOptions, monitor: str | None,
                 gradient_strategy: GradientStrategyFactory) -> None:
        self.trainer, self.options, self.monitor, self.gradient_strategy = trainer, options, monitor, gradient_strategy
        self.loop: TrainLoop | None = None
        self.steps: FrameworkStep | None = None
        self.totals: dict[str, Any] | None = None
        self.resume_from: Path | None = None  # the checkpoint train() resumes from

    # --- what the trainer subclass hands over --------------------------------------------------
    def add(self, loss: torch.Tensor, samples: int) -> None:
        if self.steps is not None:
            self.steps.add(loss)
            self.steps.add_samples(samples)

    def add_logged(self, logs: dict[str, Any]) -> None:
        """raycomp's values (:meth:`FrameworkStep.logged`) added to a log entry while training."""
        if self.steps is not None:
            logs.update(self.steps.logged())

    def close(self) -> None:
        """Release the loop's thread and files without a collective (training stopped early)."""
        if self.loop is not None and self.totals is None:
            self.loop.close()
        self.steps = None

    # --- the Trainer's events ----------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        model = trainer.model_wrapped  # accelerate's DDP (the bare model with one worker)
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside AcceleratedOptimizer
        resume = None
        if self.resume_from is not None:
            rank, world = dist.get_rank() if dist.is_initialized() else 0, args.world_size
            own = state_files.load_state(self.resume_from / STATE_DIR, rank, world)
            resume = state_files.resume_with(own, state.global_step)
        self.totals = None
        self.loop = start_loop(model, optimizer, grad_scaler=trainer.accelerator.scaler, options=self.options,
                               gradient_strategy=self.gradient_strategy, owns_optimizer=False, resume=resume)
        if self.loop.model is not model:
            raise ValueError("gradient_strategy: under the Trainer the factory must return the DDP model it was "
                             "given as its model (the Trainer keeps training that one)")
        self.steps = FrameworkStep(self.loop)
        self.loop.last_step = state.max_steps if state.max_steps > 0 else None  # optimizer steps in all

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.loop is not None:
            self.loop.epoch = math.floor((state.epoch or 0) + 1e-6)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.steps is not None:
            self.steps.before_optimizer_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.steps is not None:
            self.steps.after_optimizer_step()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.loop is None or self.totals is not None:
            return
        directory = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / STATE_DIR
        state_files.save_state(self.loop, directory)
        if dist.is_initialized():  # every rank's file, and rank 0's checkpoint, before anyone copies it
            dist.barrier(group=self.loop.control_group)
        self.steps.checkpoint_saved()  # type: ignore[union-attr]

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics") or {}
        if self.loop is not None and self.totals is None and self.monitor in metrics:
            value = float(metrics[self.monitor])
            self.loop.record_eval({self.monitor: value}, value)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.loop is not None and self.totals is None:
            self.totals = finish_loop(self.loop)
