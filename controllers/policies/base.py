"""The policy interface: from a run's observations to a plan, with the policy's state typed.

::

    policy.state                     a dataclass: everything the policy has learned
    policy.decide(run) -> Decision   run: the RunState the controller merged from every
                                     rank's reports (read only); the plan and a typed why
                                     (decision.py; each policy's why beside it)
    policy.state_dict()              the state through one generic serialiser (serial.py),
                                     with a schema version; load_state_dict() reads it back

A policy owns its state object and changes it only inside ``decide``/``warmup``; a wrapper
(the local-step choice, the fallback gate) holds the policy it wraps as ``inner``, whose
state is saved beside its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from raycomp.config.base import CompressorConfig
from raycomp.plan import CompressorSpec, Plan

from ..state import RunState
from . import serial
from .decision import Decision, Said

MIN_COMPRESS_NUMEL = 1024  # the reducer's default


@dataclass
class Stateless:
    """The state of a policy that learns nothing."""


class Policy(ABC):
    """Decides a plan from a :class:`RunState`; everything it learns is in :attr:`state`.

    ``decide`` is called after every merged boundary step once the warm-up is over
    (``warmup`` during it), and returns a :class:`Decision` whose plan has no version (the
    service numbers plans and drops repeats), or ``None`` to keep the current plan.
    ``options`` is an instance of :attr:`options_model` (validated by
    :func:`raycomp.controllers.policies.make_policy`), or the options as given for a policy without
    one.
    """

    name: ClassVar[str]
    #: the policy's typed options (a pydantic model, best a :class:`PolicyOptions`; None:
    #: options pass as given)
    options_model: ClassVar[type[BaseModel] | None] = None
    #: the policy this one wraps, whose state is saved with it (None: it wraps none)
    inner: Policy | None = None

    def __init__(self, options: Any, min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        self.options = options
        # layers smaller than this stay dense on the workers; the service passes the job's value
        self.min_numel = int(min_compress_numel)
        #: everything the policy learns, one typed dataclass (replaced by ``load_state_dict``)
        self.state: Any = Stateless()

    @abstractmethod
    def decide(self, run: RunState) -> Decision | None: ...

    def warmup(self, run: RunState) -> Decision | None:
        """The decision at a boundary inside ``compression.warmup_steps``: dense. A policy
        may measure here and choose what it trusts that early (the adaptive one:
        near-lossless rungs where they save time)."""
        return Decision.of(Plan(), Said("warmup.dense", "warm-up: dense"))

    def details(self) -> dict[str, Any]:
        """Per-policy facts for summary.json (what it decided and why)."""
        return {}

    def cost_models(self) -> list[Any]:
        """The cost models this policy (and what it wraps) measures the run with."""
        return [] if self.inner is None else self.inner.cost_models()

    def state_dict(self) -> dict[str, Any]:
        """:attr:`state` through the generic serialiser, and the wrapped policy's beside it."""
        saved = {"state": serial.dump(self.state)}
        if self.inner is not None:
            saved["inner"] = self.inner.state_dict()
        return saved

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Read back :meth:`state_dict` (empty: nothing saved yet, start fresh)."""
        if not saved:
            return
        self.state = serial.load(type(self.state), saved["state"])
        self.restored()
        if self.inner is not None:
            self.inner.load_state_dict(saved["inner"])

    def restored(self) -> None:  # noqa: B027 - most policies keep no part of the state elsewhere
        """Hand parts of a freshly loaded :attr:`state` to the objects that work on them."""


def spec(config: CompressorConfig) -> CompressorSpec:
    """The spec of a compressor named in a policy's options."""
    return config.spec()


def compressible_layers(run: RunState, min_numel: int) -> list[str]:
    return [name for name, h in run.layers.items() if h.numel >= min_numel]


__all__ = ["MIN_COMPRESS_NUMEL", "Policy", "Stateless", "compressible_layers", "spec"]
