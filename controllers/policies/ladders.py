"""The adaptive policy's ladders: per layer, its candidate compressors from the heaviest
compression to dense, and where a floor and a shift put a layer on its ladder.

A ladder holds, heaviest first: the lossy rungs (PowerSGD ranks for a matrix they shrink,
else Top-K ratios; none on a sharded run or with ``lossy: never``), the near-lossless rungs
(any compressor whose :class:`raycomp.compressors.Cost` says near-lossless: int4, int8,
bf16, or one registered by a user), then dense.
"""

from __future__ import annotations

from controllers.policies.cost_model import matrix
from controllers.state import LayerHistory
from raycomp.compressors import REGISTRY, compressor_class
from raycomp.plan import DENSE, CompressorSpec

LOWRANK, ALLGATHER = "powersgd", "topk"  # the lossy rungs' compressors
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
    if name == DENSE.name or cost is None or not cost.near_lossless:
        return "is not a near-lossless compressor"
    try:
        bytes_per_element(name)
    except (TypeError, ValueError, NotImplementedError):
        return "cannot be a rung: it must build without parameters and declare payload_bytes"
    return None


class Ladders:
    """The ladders of one run's compressible layers, built from the policy's options."""

    def __init__(self, ranks: list[int], ratios: list[float], near_lossless: list[str],
                 lossy: bool, sharded: bool) -> None:
        self.ranks = sorted({int(r) for r in ranks})
        self.ratios = sorted({float(r) for r in ratios})
        self.near_lossless = list(near_lossless)
        self.lossy = lossy and not sharded
        self._specs: dict[tuple[str, float], CompressorSpec] = {}

    def ladder(self, h: LayerHistory) -> list[CompressorSpec]:
        rows, cols = matrix(h)
        ranks = [r for r in self.ranks if (rows + cols) * min(r, rows, cols) < rows * cols]
        lossy = ([] if not self.lossy else [self._spec(LOWRANK, r) for r in ranks] if ranks
                 else [self._spec(ALLGATHER, r) for r in self.ratios])
        return [*lossy, *(self._spec(n) for n in self.near_lossless), DENSE]

    def first_near_lossless(self, ladder: list[CompressorSpec]) -> int:
        """The first near-lossless rung (int4 by default), right after the lossy ones."""
        return len(ladder) - 1 - len(self.near_lossless)

    def cap(self, ladder: list[CompressorSpec]) -> int:
        """The lightest rung a floor or a compressed shift reaches: the last near-lossless
        rung (bf16). Dense is only the all-dense candidate (and the guard's fallback).
        Without near-lossless rungs, dense."""
        return len(ladder) - (2 if self.near_lossless else 1)

    def rung(self, ladder: list[CompressorSpec], floor: int, shift: int, levels: int, top: int) -> int:
        """The rung of a layer at ``shift``: the shift is a level, the same on every ladder
        for the near-lossless rungs, and the floor a minimum (a layer above the level stays
        on its floor). ``levels``: the most lossy rungs a ladder has; ``top``: the all-dense
        shift."""
        if shift >= top:
            return len(ladder) - 1
        lossy = self.first_near_lossless(ladder)  # this ladder's lossy rungs
        level = shift if shift < lossy else lossy + max(0, shift - levels)
        return min(max(floor, level), self.cap(ladder))

    def _spec(self, family: str, value: float = 0.0) -> CompressorSpec:
        key = (family, value)
        if key not in self._specs:
            if family == LOWRANK:
                self._specs[key] = CompressorSpec.of(LOWRANK, rank=int(value))
            elif family == ALLGATHER:
                self._specs[key] = CompressorSpec.of(ALLGATHER, ratio=value)
            else:  # a near-lossless rung: no parameter
                self._specs[key] = CompressorSpec.of(family)
        return self._specs[key]


def label(spec: CompressorSpec) -> str:
    """How a rung reads in a plan's reason."""
    params = dict(spec.params)
    if spec.name == LOWRANK:
        return f"powersgd r={params['rank']}"
    if spec.name == ALLGATHER:
        return f"topk {params['ratio']:g}"
    return spec.name


__all__ = ["Ladders", "bytes_per_element", "check_near_lossless", "heaviest_first", "label",
           "near_lossless_names"]
