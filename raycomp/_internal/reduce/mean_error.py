"""The compression error of what every rank applies, against the exact mean.

A rank's own relative error ``||c - sent|| / ||c||`` (:mod:`raycomp._internal.reduce.stats`) says how much of
its input a compressor kept, not how far the step every rank applies is from the one dense
training would apply: errors of several ranks partly cancel in the mean, and a route that
quantizes twice (the scalable all-to-all, then the reduced chunks again) adds an error that
no rank's own contribution shows. So it meant one thing at two ranks and another at four,
or in two levels. This module measures the error of the mean itself, the same at every
``W``, flat and in two levels:

    error(layer) = ||applied mean - exact mean of the compensated inputs|| / ||exact mean||

exactly, on a fixed strided sample of :data:`SAMPLES` elements of each layer (of each
rank's piece, in two levels), on statistics steps. Every rank keeps its sample of its input
and of the mean it applied (:func:`sample`); at the next agreement one all-gather brings
every rank's samples to every rank (:func:`layer_errors`), which averages the inputs of the
ranks that reduced the same piece (all ranks flat; the ranks of one position on their nodes
in two levels) and compares the mean they applied. Every rank computes the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SAMPLES", "layer_errors", "sample"]

#: elements sampled per layer (per piece): 1 KiB of float32 per layer and rank
SAMPLES = 128


def sample(compensated: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(2, n <= SAMPLES): an evenly strided sample of ``compensated`` (this rank's input to
    the compressor) and of ``mean`` (what every rank applies) at the same places."""
    vector = compensated.detach().reshape(-1)
    stride = max(1, vector.numel() // SAMPLES)
    return torch.stack([vector[::stride][:SAMPLES].float(), mean.detach().reshape(-1)[::stride][:SAMPLES].float()])


def layer_errors(samples: Mapping[str, torch.Tensor], layers: Sequence[str], position: int,
                 group: Any = None) -> dict[str, float]:
    """Each sampled layer's relative error of the applied mean (the module's formula), the
    same on every rank. A collective over ``group`` (one all-gather): every rank passes the
    same ``layers``, in the same order, and its ``position`` in the reduction (0 flat; its
    local rank in two levels: the ranks of one position reduced the same pieces). A layer
    no rank sampled, or whose exact mean is zero, is left out."""
    table = torch.zeros(len(layers) + 1, 2, SAMPLES, dtype=torch.float32)
    table[0, 0, 0] = position  # a header row: where this rank's pieces lie
    for i, name in enumerate(layers, start=1):
        mine = samples.get(name)
        if mine is not None:
            table[i, :, :mine.shape[1]] = mine.cpu()
    rows = [table]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        rows = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, table, group=group)
    positions = [int(row[0, 0, 0]) for row in rows]
    every = torch.stack(rows)[:, 1:].double()  # (world, layers, 2, SAMPLES)
    error2 = torch.zeros(len(layers), dtype=torch.float64)
    exact2 = torch.zeros(len(layers), dtype=torch.float64)
    for position in sorted(set(positions)):
        ranks = [r for r, p in enumerate(positions) if p == position]
        exact = every[ranks, :, 0, :].mean(0)  # the mean of the inputs of the ranks that reduced it
        applied = every[ranks[0], :, 1, :]  # the same on each of them
        error2 += (applied - exact).square().sum(-1)
        exact2 += exact.square().sum(-1)
    return {name: math.sqrt(float(error2[i] / exact2[i])) for i, name in enumerate(layers) if exact2[i] > 0}
