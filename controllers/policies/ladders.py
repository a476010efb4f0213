"""The adaptive policy's ladders: per layer, its candidate compressors from the heaviest
compression to dense, and where a floor and a shift put a layer on its ladder.

A ladder holds, heaviest first: the lossy rungs (PowerSGD ranks for a matrix they shrink,
else Top-K ratios; none on a sharded run or with ``lossy: never``), the near-lossless rungs
(any compressor whose :class:`raycomp.compressors.Cost` says near-lossless: int4, int8,
bf16, or one registered by a user; :mod:`raycomp.compressors.near_lossless` says which),
then dense.
"""

from __future__ import annotations

from raycomp.plan import DENSE, CompressorSpec

from ..state import LayerHistory
from .layer_sizes import matrix

LOWRANK, ALLGATHER = "powersgd", "topk"  # the lossy rungs' compressors


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

    def rung(self, ladder: list[CompressorSpec], floor: int, shift: int, most_lossy: int, top: int) -> int:
        """The rung of a layer at ``shift``: the shift is a rung position, the same on every
        ladder for the near-lossless rungs, and the floor a minimum (a layer above that
        position stays on its floor). ``most_lossy``: the most lossy rungs a ladder has;
        ``top``: the all-dense shift."""
        if shift >= top:
            return len(ladder) - 1
        lossy = self.first_near_lossless(ladder)  # this ladder's lossy rungs
        position = shift if shift < lossy else lossy + max(0, shift - most_lossy)
        return min(max(floor, position), self.cap(ladder))

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


__all__ = ["Ladders", "label"]
