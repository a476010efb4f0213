"""The policy interface: from a run's aggregated statistics to per-layer compressors, and
the base of a policy's typed options."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel

from controllers.state import RunState
from raycomp.config.base import CompressorConfig, Strict
from raycomp.plan import CompressorSpec, Plan

MIN_COMPRESS_NUMEL = 1024  # the reducer's default


class PolicyOptions(Strict):
    """The options of a policy, ``compression.<policy>`` in a job config: strict (unknown
    keys refused), frozen, one-line errors naming the key.

    A sharded run (FSDP) reduce-scatters its gradients, and only some compressors can carry
    a reduce-scatter row (``raycomp.compressors.fits_a_shard``): a policy that may run there
    sets :attr:`not_shardable` to None and checks its options in :meth:`check_sharded`.
    """

    #: why the policy cannot steer a sharded run (the end of a one-line error), or None
    not_shardable: ClassVar[str | None] = "may choose compressors that cannot compress a reduce-scatter shard"

    def check_sharded(self, key: str) -> None:
        """ValueError (one line, naming the option under ``key``, e.g. ``compression.static``)
        unless every compressor these options may choose fits a reduce-scatter row."""

    @staticmethod
    def check_fits_a_shard(key: str, chosen: CompressorConfig) -> None:
        """ValueError naming ``key`` unless ``chosen`` can compress a reduce-scatter row."""
        from raycomp.compressors import fits_a_shard, shardable

        if not fits_a_shard(chosen.name):
            raise ValueError(f"{key}: {chosen.name!r} cannot compress a reduce-scatter shard; "
                             f"allowed with scaling.strategy=fsdp: {', '.join(shardable())}")


class Policy(ABC):
    """Decides a plan from a :class:`RunState`; holds only its own small state.

    ``decide`` is called after every merged boundary step once warm-up is over, and
    returns a plan without a version (the service numbers plans and drops repeats), or
    ``None`` to keep the current plan. ``options`` is an instance of :attr:`options_model`
    (validated by :func:`controllers.policies.make_policy`), or the options as given for a
    policy without one.
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


__all__ = ["MIN_COMPRESS_NUMEL", "Policy", "PolicyOptions", "compressible_layers", "spec"]
