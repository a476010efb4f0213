"""Gradient compressors, one family per module, and the name -> class registry.

A compressor is named in a plan or config by one of:

* a built-in name (:data:`COMPRESSORS`);
* a name given to :func:`register` in this process;
* an import path ``"package.module:Class"``, imported on first use in whichever process
  builds the compressor (driver, controller actor, Ray Train workers): the robust way to
  use your own compressor across processes, since a plan carries only the name.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from raycomp.compressors.base import Compressor, Transport
from raycomp.compressors.casts import Bf16, Fp16
from raycomp.compressors.dense import Dense
from raycomp.compressors.minmax import MinMaxInt4, MinMaxInt8
from raycomp.compressors.powersgd import PowerSGD
from raycomp.compressors.qsgd import QSGD
from raycomp.compressors.randomk import RandomK
from raycomp.compressors.sign import ScaledSign
from raycomp.compressors.terngrad import TernGrad
from raycomp.compressors.threshold import Threshold
from raycomp.compressors.topk import SampledTopK, TopK
from raycomp.imports import import_object

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        Dense,
        Fp16,
        Bf16,
        TopK,
        SampledTopK,
        RandomK,
        Threshold,
        QSGD,
        TernGrad,
        ScaledSign,
        MinMaxInt8,
        MinMaxInt4,
        PowerSGD,
    )
}


def compressor_parameters(name: str) -> list[str]:
    """The parameters a compressor accepts (constructor keywords)."""
    signature = inspect.signature(compressor_class(name).__init__)
    # classes without their own __init__ show object's (self, /, *args, **kwargs): no keywords
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name for p in signature.parameters.values() if p.name != "self" and p.kind not in variadic
    ]


_REGISTERED: dict[str, type[Compressor] | str] = {}  # user names -> class or import path
_IMPORTED: dict[str, type[Compressor]] = {}  # import path -> class, per process
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def register(name: str, compressor: type[Compressor] | str, *, replace: bool = False) -> None:
    """Make ``name`` build ``compressor`` (a :class:`Compressor` subclass or its import path
    ``"package.module:Class"``) in this process.

    Registrations are per process: call this at module level in a module every process that
    builds compressors imports (for Ray Train, the module of your training function), or
    name the compressor by its import path in plans and configs, which needs no
    registration anywhere. Registering the same target again is a no-op; another target
    under a taken name needs ``replace=True``; built-in names cannot be replaced.
    """
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"compressor name {name!r}: expected letters, digits, '_', '.' or '-' "
                         "(at most 64, starting with a letter or '_')")
    if name in COMPRESSORS:
        raise ValueError(f"compressor name {name!r} is built in; choose another name")
    if isinstance(compressor, str):
        if not IMPORT_PATH.match(compressor):
            raise ValueError(f"compressor {name!r}: {compressor!r} is not an import path 'package.module:Class'")
    else:
        _check_class(name, compressor)
    current = _REGISTERED.get(name)
    if current is not None and current != compressor and not replace:
        raise ValueError(f"compressor name {name!r} is already registered to {_describe(current)}; "
                         "pass replace=True to change it")
    _REGISTERED[name] = compressor


def unregister(name: str) -> None:
    """Forget a name given to :func:`register` (built-in names stay)."""
    if name not in _REGISTERED:
        raise ValueError(f"compressor name {name!r} is not registered; registered: "
                         f"{', '.join(sorted(_REGISTERED)) or '(none)'}")
    del _REGISTERED[name]


def registered() -> dict[str, str]:
    """User registrations in this process: name -> ``module:Class``."""
    return {name: _describe(target) for name, target in sorted(_REGISTERED.items())}


def compressor_class(name: str) -> type[Compressor]:
    if name in COMPRESSORS:
        return COMPRESSORS[name]
    target = _REGISTERED.get(name)
    if target is None and isinstance(name, str) and IMPORT_PATH.match(name):
        target = name
    if target is None:
        users = f", {', '.join(sorted(_REGISTERED))}" if _REGISTERED else ""
        raise ValueError(
            f"compressor: unknown name {name!r}; allowed: {', '.join(sorted(COMPRESSORS))}{users}, "
            "or an import path 'package.module:Class'"
        )
    return target if not isinstance(target, str) else _import(name, target)


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


def _import(name: str, path: str) -> type[Compressor]:
    cls = _IMPORTED.get(path)
    if cls is None:
        try:
            obj = import_object(path)
        except ValueError as error:
            raise ValueError(f"compressor {name!r}: {error}") from None
        cls = _IMPORTED[path] = _check_class(name, obj)
    return cls


def _check_class(name: str, cls: Any) -> type[Compressor]:
    if not (inspect.isclass(cls) and issubclass(cls, Compressor)):
        raise ValueError(f"compressor {name!r}: {cls!r} is not a subclass of raycomp.compressors.Compressor")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"compressor {name!r}: {cls.__name__} does not implement {missing}")
    if not isinstance(getattr(cls, "name", None), str) or not isinstance(getattr(cls, "transport", None), Transport):
        raise ValueError(f"compressor {name!r}: {cls.__name__} must set the class attributes "
                         "'name' (a string) and 'transport' (a raycomp.compressors.Transport)")
    return cls


def _describe(target: type[Compressor] | str) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def make_compressor(name: str, **params: Any) -> Compressor:
    """Build a compressor by registry name; unknown names or parameters raise ValueError."""
    cls = compressor_class(name)
    allowed = compressor_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"compressor {name!r}: unknown parameter {unknown[0]!r}; "
            f"allowed: {', '.join(allowed) if allowed else '(none)'}"
        )
    return cls(**params)


__all__ = [
    "COMPRESSORS",
    "Compressor",
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
