"""The policy interface: from a run's aggregated statistics to per-layer compressors, and
the base of a policy's typed options."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel

from controllers.state import RunState
from raycomp.config.base import CompressorConfig
from raycomp.plan import CompressorSpec, Plan

MIN_COMPRESS_NUMEL = 1024  # the reducer's default


class Policy(ABC):
    """Decides a plan from a :class:`RunState`; holds only its own small state.

    ``decide`` is called after every merged boundary step once the warm-up is over
    (``warmup`` during it), and returns a plan without a version (the service numbers plans
    and drops repeats), or ``None`` to keep the current plan. ``options`` is an instance of
    :attr:`options_model` (validated by :func:`controllers.policies.make_policy`), or the
    options as given for a policy without one.
    """

    name: ClassVar[str]
    #: the policy's typed options (a pydantic model, best a :class:`PolicyOptions`; None:
    #: options pass as given)
    options_model: ClassVar[type[BaseModel] | None] = None

    def __init__(self, options: Any, min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        self.options = options
        # layers smaller than this stay dense on the workers; the service passes the job's value
        self.min_numel = int(min_compress_numel)

    @abstractmethod
    def decide(self, run: RunState) -> Plan | None: ...

    def warmup(self, run: RunState) -> Plan | None:
        """The plan at a boundary inside ``compression.warmup_steps``: dense. A policy may
        measure here and choose what it trusts that early (the adaptive one: near-lossless
        rungs where they save time)."""
        return Plan(reason="warm-up: dense")

    def details(self) -> dict[str, Any]:
        """Per-policy facts for summary.json (what it decided and why)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        return None


def spec(config: CompressorConfig) -> CompressorSpec:
    """The spec of a compressor named in a policy's options."""
    return config.spec()


def compressible_layers(run: RunState, min_numel: int) -> list[str]:
    return [name for name, h in run.layers.items() if h.numel >= min_numel]


__all__ = ["MIN_COMPRESS_NUMEL", "Policy", "compressible_layers", "spec"]
