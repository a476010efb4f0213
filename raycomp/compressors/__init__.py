"""Gradient compressors, one family per module, and the name -> class registry."""

from __future__ import annotations

import inspect
from typing import Any

from raycomp.compressors.base import Compressor, Transport
from raycomp.compressors.casts import Bf16, Fp16
from raycomp.compressors.dense import Dense
from raycomp.compressors.int8 import MinMaxInt8
from raycomp.compressors.powersgd import PowerSGD
from raycomp.compressors.qsgd import QSGD
from raycomp.compressors.randomk import RandomK
from raycomp.compressors.sign import ScaledSign
from raycomp.compressors.terngrad import TernGrad
from raycomp.compressors.threshold import Threshold
from raycomp.compressors.topk import SampledTopK, TopK

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


def compressor_class(name: str) -> type[Compressor]:
    if name not in COMPRESSORS:
        raise ValueError(
            f"compressor: unknown name {name!r}; allowed: {', '.join(sorted(COMPRESSORS))}"
        )
    return COMPRESSORS[name]


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
    "Transport",
    "compressor_class",
    "compressor_parameters",
    "make_compressor",
    *(cls.__name__ for cls in COMPRESSORS.values()),
]
