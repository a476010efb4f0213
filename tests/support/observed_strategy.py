"""A gradient sync that hands everything to raycomp's DDP hook sync and records each
``after_optimizer_step`` it receives: where a local-step sync merges the ranks' weights.
The framework integrations' tests use it to show that the framework's step reaches that
extension point once per optimizer step, after the step's reduction, with the guard's
verdict."""

from __future__ import annotations

from typing import Any

import torch

from raycomp._internal.train.ddp_strategy import DdpStrategy, ddp_hook_strategy
from raycomp.train.gradient_strategy import GradientStrategy, StrategySetup


class ObservedStrategy(GradientStrategy):
    """:class:`~raycomp._internal.train.ddp_strategy.DdpStrategy`'s protocol, delegated; ``calls`` holds
    ``(reductions so far, applied)`` per ``after_optimizer_step``."""

    def __init__(self, inner: DdpStrategy) -> None:
        self.inner = inner
        self.model, self.state, self.sharded = inner.model, inner.state, inner.sharded
        self.bucket_cap_mb = inner.bucket_cap_mb
        self.calls: list[tuple[int, bool]] = []

    def layers(self) -> dict[str, list[int]]:
        return self.inner.layers()

    def end_backward(self) -> None:
        self.inner.end_backward()

    @property
    def per_step(self) -> bool:
        return self.inner.per_step

    def agreement(self) -> tuple[float, ...]:
        return self.inner.agreement()

    def after_optimizer_step(self, applied: bool, loss: float) -> None:
        self.calls.append((self.state.step, applied))
        return self.inner.after_optimizer_step(applied, loss)


def observed_ddp_hook_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> Any:
    """A ``gradient_strategy`` factory: :func:`raycomp._internal.train.ddp_strategy.ddp_hook_strategy`, observed."""
    return ObservedStrategy(ddp_hook_strategy(model, optimizer, setup))
