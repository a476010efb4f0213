"""``strategy="ddp"``: the model in DDP (``ray.train.torch.prepare_model``); DDP's own
reduction while the plan is dense, raycomp's comm hook (each bucket's all-reduce compressed
as the plan says) from the first step that compresses (:mod:`raycomp._internal.ddp.step_route`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raycomp._internal.ddp.buckets import ddp_kwargs
from raycomp._internal.ddp.hook import CompressionState, compression_hook
from raycomp._internal.ddp.step_route import StepRoute
from raycomp._internal.topology import discover
from raycomp._internal.train.gradient_strategy import GradientStrategy, StrategySetup
from raycomp.plan import Plan

__all__ = ["DdpStrategy", "compression_state", "ddp_hook_strategy", "ddp_strategy", "parameter_shapes", "wrap_ddp"]


class DdpStrategy(GradientStrategy):
    """A :class:`~raycomp.train.gradient_strategy.GradientStrategy` over a DDP model (or, with one
    worker, the bare model) and its :class:`~raycomp._internal.ddp.hook.CompressionState`.

    On a DDP model each step's gradients travel the way :class:`raycomp._internal.ddp.step_route.StepRoute`
    decides before its forward: DDP's own reduction while the plan is dense, raycomp's hook
    from the first step that compresses. ``hook=None`` leaves DDP's reduction to whoever
    registered a hook of their own (a benchmark's torch hook): then nothing of raycomp
    travels with the gradients, and the guard's values take an all-reduce of their own.
    """

    sharded = False
    per_step = True  # every step's gradients are reduced

    def __init__(self, model: torch.nn.Module, state: CompressionState,
                 hook: Callable[..., Any] | None = compression_hook) -> None:
        self.model, self.state = model, state
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self.bucket_cap_mb = model.bucket_bytes_cap / 2**20 if self.ddp else None
        self.sync = StepRoute(model, state, hook) if self.ddp and hook is not None else None

    def layers(self) -> dict[str, list[int]]:
        return parameter_shapes(self.model)

    @property
    def per_node(self) -> int:
        """The ranks of a node when compressed steps reduce in two levels, else 1."""
        return self.state.per_node

    def time_node_link(self) -> float | None:
        """Seconds per byte inside a node, timed (two levels), else None. Collective."""
        return self.state.time_node_link()

    def end_backward(self) -> None:
        if not self.ddp:  # one process: no hook ran; local compression + memory
            self.state.allreduce_gradients()
        elif self.sync is not None:
            self.sync.end_backward()

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
                            profile_ratios=profile, grad_scaler=setup.grad_scaler,
                            topology=discover() if c.levels == "auto" else None)


def ddp_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> DdpStrategy:
    """raycomp's DDP path: buckets of ``compression.bucket_cap_mb``; DDP's own reduction
    while the plan is dense, the compressed hook from the first compressed step
    (:class:`DdpStrategy`)."""
    model = wrap_ddp(model, setup, ddp_kwargs(setup.options.compression, model))
    return ddp_hook_strategy(model, optimizer, setup)


def ddp_hook_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> DdpStrategy:
    """raycomp on a model that is already wrapped in DDP, as a framework wraps it
    (Lightning's DDP strategy, accelerate under the Hugging Face Trainer): no second wrap,
    the DDP instance's own buckets. A model that is not a DDP (one worker) is reduced
    locally after backward. Call it before the model's first backward: DDP takes one comm
    hook, and :class:`DdpStrategy` registers raycomp's when a step first compresses."""
    return DdpStrategy(model, compression_state(model, setup))
