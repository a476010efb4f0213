"""Which compressors may be the adaptive policy's near-lossless rungs, and their order.

A near-lossless rung is any compressor whose :class:`~raycomp.compressors.Cost` says
near-lossless (int4, int8, bf16, fp16, or one a user registered) that builds without
parameters and declares its payload bytes: the ladder compares rungs by those bytes. The
job config checks ``compression.adaptive.near_lossless`` with these functions, and the
controller builds its ladders from what they return.
"""

from __future__ import annotations

from raycomp.compressors import REGISTRY, compressor_class

_REFERENCE_NUMEL = 1 << 20  # the tensor size bytes per element are compared at


def near_lossless_names() -> list[str]:
    """The compressors this process knows that can be near-lossless rungs (dense aside),
    heaviest compression first."""
    return heaviest_first([n for n in REGISTRY.names() if _problem(n) is None])


def check_near_lossless(name: str) -> str:
    """``name`` if it can be a near-lossless rung; else ValueError (one line) naming the
    allowed ones."""
    problem = _problem(name)
    if problem is not None:
        raise ValueError(f"{name!r} {problem}; allowed: {', '.join(near_lossless_names())}, "
                         "or a compressor of yours that declares a near-lossless Cost")
    return name


def heaviest_first(names: list[str]) -> list[str]:
    """``names`` once each, by declared bytes per element, fewest first (ties: as given)."""
    unique = list(dict.fromkeys(names))
    return sorted(unique, key=bytes_per_element)


def bytes_per_element(name: str) -> float:
    """The payload bytes per fp32 element of a parameterless compressor, on a large tensor."""
    n = _REFERENCE_NUMEL
    return compressor_class(name)().payload_bytes(n, (n,), 4.0) / n


def _problem(name: str) -> str | None:
    """Why ``name`` cannot be a near-lossless rung (None: it can)."""
    try:
        cost = compressor_class(name).cost
    except ValueError:
        return "is not a compressor"
    if name == "none" or cost is None or not cost.near_lossless:  # "none": dense, the ladder's last rung
        return "is not a near-lossless compressor"
    try:
        bytes_per_element(name)
    except (TypeError, ValueError, NotImplementedError):
        return "cannot be a rung: it must build without parameters and declare payload_bytes"
    return None


__all__ = ["bytes_per_element", "check_near_lossless", "heaviest_first", "near_lossless_names"]
