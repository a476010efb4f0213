"""``strategy="ddp"``: the model in DDP (``ray.train.torch.prepare_model``) with raycomp's
comm hook, which compresses each bucket's all-reduce as the plan says."""

from __future__ import annotations

from typing import Any

import torch

from raycomp.buckets import ddp_kwargs
from raycomp.hook import CompressionState, compression_hook
from raycomp.plan import Plan
from raycomp.train.gradient_strategy import StrategySetup

__all__ = ["DdpStrategy", "compression_state", "ddp_hook_strategy", "ddp_strategy", "parameter_shapes", "reduces_after_backward",
           "wrap_ddp"]


class DdpStrategy:
    """A :class:`~raycomp.train.gradient_strategy.GradientStrategy` over a DDP model (or, with one
    worker, the bare model) and its :class:`~raycomp.hook.CompressionState`.

    ``after_backward``: a plain step (:mod:`raycomp.plain_step`: a plan that sends
    everything dense, nothing held in error feedback;
    :meth:`~raycomp.hook.CompressionState.next_step_plain`) is reduced after backward
    instead of in DDP's comm hook. Before the step's forward DDP's
    gradient sync is switched off for it (``require_backward_grad_sync``, what ``no_sync()``
    sets); :meth:`end_backward` all-reduces every gradient in one buffer, with the guard's
    control values, switches it back on and lets the next forward broadcast the buffers
    as after a synchronised step. What it saves is the Python comm hook itself, a few
    percent of a small model's step; what it gives up is the overlap of buckets with
    backward, so it is only for models of at most two buckets
    (:func:`reduces_after_backward`), where that overlap is worth less than the hook.
    A forward inside the user's own ``no_sync()`` is left alone.
    """

    sharded = False
    per_step = True  # every step's gradients are reduced

    def __init__(self, model: torch.nn.Module, state: CompressionState, after_backward: bool = False) -> None:
        self.model, self.state = model, state
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.bucket_cap_mb = model.bucket_bytes_cap / 2**20 if self.ddp else None
        self.deferred = False  # this step's reduction waits for end_backward (DDP's sync is off)
        if self.ddp and after_backward:
            model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Switch DDP's sync off for a step that :meth:`end_backward` reduces (decided from
        what every rank holds alike, before the step begins)."""
        if (torch.is_grad_enabled() and not self.deferred and module.require_backward_grad_sync
                and self.state.next_step_plain()):
            module.require_backward_grad_sync = False
            self.deferred = True

    def layers(self) -> dict[str, list[int]]:
        return parameter_shapes(self.model)

    def end_backward(self) -> None:
        if not self.ddp:  # one process: no hook ran; local compression + memory
            self.state.allreduce_gradients()
        elif self.deferred:
            self.deferred = False
            self.model.require_backward_grad_sync = True
            self.model.require_forward_param_sync = True  # the next forward broadcasts buffers, as DDP's does
            self.state.plain.reduce_after_backward()

    def after_optimizer_step(self, applied: bool, loss: float) -> None:
        return None  # per step: the gradients were reduced in backward

    def agreement(self) -> tuple[float, ...]:
        return ()


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """What a plan names on a DDP model (or a bare one): each trainable parameter's shape."""
    module = getattr(model, "module", model)
    return {name: list(p.shape) for name, p in module.named_parameters() if p.requires_grad}


def wrap_ddp(model: torch.nn.Module, setup: StrategySetup, ddp_options: dict[str, Any]) -> torch.nn.Module:
    """``ray.train.torch.prepare_model`` with ``ddp_options`` (DDP's keyword arguments) and
    the run's ``find_unused_parameters``."""
    import ray.train.torch

    ddp_options = dict(ddp_options)
    if setup.options.find_unused_parameters:
        ddp_options["find_unused_parameters"] = True
    return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_options)


def compression_state(model: torch.nn.Module, setup: StrategySetup) -> CompressionState:
    """The rank's compression state over ``model``, as the run's options say (dense plan)."""
    c = setup.options.compression
    profile = tuple(sorted({*c.error_budget.ratios, c.error_budget.reference_ratio})) \
        if c.policy == "error_budget" else ()
    return CompressionState(model, Plan(), memory=c.memory, min_compress_numel=c.min_compress_numel,
                            seed=setup.options.seed, stats_every=setup.options.controller.interval_steps,
                            profile_ratios=profile, grad_scaler=setup.grad_scaler)


def reduces_after_backward(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a plain step of ``model`` (a DDP) is reduced after backward
    (:class:`DdpStrategy`): on the CPU (on CUDA the hook's streams stay), without
    ``find_unused_parameters`` or ``static_graph`` (DDP's own bookkeeping of a step), and
    for at most two buckets' worth of gradients, where the buckets overlap little of
    backward."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or device.type != "cpu":
        return False
    if model.find_unused_parameters or getattr(model, "static_graph", False):
        return False
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return gradient_bytes <= 2 * model.bucket_bytes_cap


def ddp_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> DdpStrategy:
    """raycomp's DDP path: buckets of ``compression.bucket_cap_mb``, the compressed hook; a
    plain step of a small model reduced after backward (:class:`DdpStrategy`)."""
    model = wrap_ddp(model, setup, ddp_kwargs(setup.options.compression, model))
    return ddp_hook_strategy(model, optimizer, setup, after_backward=reduces_after_backward(model, setup.device))


def ddp_hook_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup,
                      after_backward: bool = False) -> DdpStrategy:
    """The compressed hook on a model that is already wrapped in DDP, as a framework wraps
    it (Lightning's DDP strategy, accelerate under the Hugging Face Trainer): no second
    wrap, the DDP instance's own buckets. A model that is not a DDP (one worker) is
    reduced locally after backward. Call it before the model's first backward: DDP takes
    a comm hook only then, and only once. ``after_backward``: see :class:`DdpStrategy`."""
    strategy = DdpStrategy(model, compression_state(model, setup), after_backward)
    if strategy.ddp:
        model.register_comm_hook(strategy.state, compression_hook)
    return strategy

