"""Gradient compressors, one family per module, and the registry that names them.

A compressor is named in a plan or config by a built-in name (:data:`COMPRESSORS`), a name
given to :func:`register` in this process, or an import path ``"package.module:Class"``,
imported on first use in whichever process builds the compressor (driver, controller
actor, Ray Train workers): the robust way to use your own compressor across processes,
since a plan carries only the name (:mod:`raycomp._internal.registry`).
"""

from __future__ import annotations

import inspect
from typing import Any

from raycomp._internal.registry import Registry
from raycomp.compressors.base import Compressor, Cost, Transport
from raycomp.compressors.casts import Bf16, Fp16
from raycomp.compressors.dense import Dense
from raycomp.compressors.minmax import MinMaxInt4, MinMaxInt8
from raycomp.compressors.powersgd import PowerSGD
from raycomp.compressors.qsgd import QSGD
from raycomp.compressors.randomk import RandomK
from raycomp.compressors.sign import ScaledSign
from raycomp.compressors.sparseloco import SparseLoCo
from raycomp.compressors.terngrad import TernGrad
from raycomp.compressors.threshold import Threshold
from raycomp.compressors.topk import SampledTopK, TopK


def _check_class(name: str, cls: Any) -> type[Compressor]:
    if not (inspect.isclass(cls) and issubclass(cls, Compressor)):
        raise ValueError(f"compressor {name!r}: {cls!r} is not a subclass of raycomp.compressors.Compressor")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"compressor {name!r}: {cls.__name__} does not implement {missing}")
    if not isinstance(getattr(cls, "name", None), str) or not isinstance(getattr(cls, "transport", None), Transport):
        raise ValueError(f"compressor {name!r}: {cls.__name__} must set the class attributes "
                         "'name' (a string) and 'transport' (a raycomp.compressors.Transport)")
    if cls.cost is not None and not isinstance(cls.cost, Cost):
        raise ValueError(f"compressor {name!r}: {cls.__name__}.cost must be a raycomp.compressors.Cost or None, "
                         f"got {cls.cost!r}")
    return cls


#: every compressor by name: built in, registered in this process, or by import path
REGISTRY: Registry[Compressor] = Registry("compressor", "compressor", [
    Dense, Fp16, Bf16, TopK, SampledTopK, RandomK, Threshold, QSGD, TernGrad, ScaledSign,
    MinMaxInt8, MinMaxInt4, PowerSGD, SparseLoCo,
], _check_class)
#: the built-in compressors by name
COMPRESSORS: dict[str, type[Compressor]] = REGISTRY.builtins
#: parameters renamed in a release, refused under their old name with one line naming the new:
#: (class, old name) -> new name
RENAMED_PARAMETERS: dict[tuple[type[Compressor], str], str] = {(QSGD, "levels"): "points"}


def register(name: str, compressor: type[Compressor] | str, *, replace: bool = False) -> None:
    """Make ``name`` build ``compressor`` (a :class:`Compressor` subclass or its import path
    ``"package.module:Class"``) in this process.

    Registrations are per process: call this when a module is imported, in a module every
    process that builds compressors imports (for Ray Train, the module of your training
    function), or name the compressor by its import path in plans and configs, which needs
    no registration anywhere. Registering the same target again is a no-op; another target
    under a taken name needs ``replace=True``; built-in names cannot be replaced.
    """
    REGISTRY.register(name, compressor, replace=replace)


def unregister(name: str) -> None:
    """Forget a name given to :func:`register` (built-in names stay)."""
    REGISTRY.unregister(name)


def registered() -> dict[str, str]:
    """User registrations in this process: name -> ``module:Class``."""
    return REGISTRY.registered()


def compressor_class(name: str) -> type[Compressor]:
    """The class of a built-in, registered or import-path name (ValueError: one line)."""
    return REGISTRY.get(name)


def compressor_parameters(name: str) -> list[str]:
    """The parameters a compressor accepts (constructor keywords)."""
    signature = inspect.signature(compressor_class(name).__init__)
    # classes without their own __init__ show object's (self, /, *args, **kwargs): no keywords
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name for p in signature.parameters.values() if p.name != "self" and p.kind not in variadic
    ]


#: transports whose payloads have a fixed size per row, in one round (a reduce-scatter row)
ROW_TRANSPORTS = (Transport.SCALABLE, Transport.ALLREDUCE)


def fits_a_shard(name: str) -> bool:
    """Whether compressor ``name`` can compress one row of a sharded run's reduce-scatter:
    a payload of fixed size, one round, its own random draws (``none`` fits: fp32 rows)."""
    if name == "none":
        return True
    cls = compressor_class(name)
    return cls.transport in ROW_TRANSPORTS and not cls.variable_size and not cls.shared_randomness


def shardable() -> list[str]:
    """The built-in compressors that :func:`fits_a_shard`, ``none`` first."""
    return ["none", *sorted(n for n in COMPRESSORS if n != "none" and fits_a_shard(n))]


def make_compressor(name: str, **params: Any) -> Compressor:
    """Build a compressor by registry name; unknown names or parameters raise ValueError."""
    cls = compressor_class(name)
    allowed = compressor_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    for old in unknown:
        new = RENAMED_PARAMETERS.get((cls, old))
        if new is not None:
            raise ValueError(f"compressor {name!r}: parameter {old!r} is now {new!r}; write {new}: "
                             f"{params[old]!r} (the same value, the same meaning)")
    if unknown:
        raise ValueError(
            f"compressor {name!r}: unknown parameter {unknown[0]!r}; "
            f"allowed: {', '.join(allowed) if allowed else '(none)'}"
        )
    return cls(**params)


__all__ = [
    "COMPRESSORS",
    "Compressor",
    "Cost",
    "REGISTRY",
    "ROW_TRANSPORTS",
    "Transport",
    "compressor_class",
    "compressor_parameters",
    "fits_a_shard",
    "shardable",
    "make_compressor",
    "register",
    "registered",
    "unregister",
    *(cls.__name__ for cls in COMPRESSORS.values()),
]
