"""What the ranks of a two-level checkpoint owe the global mean, over whole layers.

A two-level rank (:mod:`raycomp._internal.reduce.two_level`) at position ``i`` of its node holds the residual
of piece ``i`` of each layer, at the scale of the node's mean; the cross-node reduction of
position ``i`` owes the global mean the mean over the ``K`` nodes of those residuals. So the
whole owed correction is ``(1/K) sum over old ranks of their piece, put back in place``. The
scalable route's server residuals are chunks of a position's piece, one per cross-node rank,
already at the mean's scale: put back in place, each once.

:func:`raycomp._internal.train.resize.merge_reducer` gives every new rank these owed means (a flat
rank keeps them, a two-level one cuts out its piece), so the new ranks owe what the old
ones did, whatever the new size or layout.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from raycomp._internal.reduce.memory import PER_LAYER_STATE
from raycomp._internal.reduce.two_level import cut
from raycomp._internal.transports.packing import chunk_sizes

__all__ = ["owed_memory", "owed_server_residuals"]


def owed_memory(states: list[dict[str, Any]], shapes: dict[str, Any]) -> dict[str, Any]:
    """The merged memory state: per-layer tensors the owed mean over whole layers (float64
    sums, stored as fp32, on the CPU); the rest (DGC's settings) from old rank 0."""
    first = states[0]["memory"]
    memory: dict[str, Any] = {key: copy.deepcopy(value) for key, value in first.items()
                              if key not in PER_LAYER_STATE}
    for key in PER_LAYER_STATE:
        if not any(key in s["memory"] for s in states):
            continue
        totals: dict[str, torch.Tensor] = {}
        for state in states:
            place = state["levels"]
            for name, piece in state["memory"].get(key, {}).items():
                shape = torch.Size(shapes[name])
                offset, size, _ = cut(shape, place["per_node"])[place["position"]]
                total = totals.setdefault(name, torch.zeros(shape.numel(), dtype=torch.float64))
                total[offset:offset + size] += piece.detach().cpu().reshape(-1).to(torch.float64)
        nodes = states[0]["levels"]["nodes"]
        memory[key] = {name: (total / nodes).to(torch.float32).view(torch.Size(shapes[name]))
                       for name, total in totals.items()}
    return memory


def owed_server_residuals(states: list[dict[str, Any]], shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each layer's server residuals over the whole layer (flat): chunk ``c`` of piece ``i``
    from the rank at position ``i`` and cross-node rank ``c`` (zeros where none was kept)."""
    full: dict[str, torch.Tensor] = {}
    for state in states:
        place = state["levels"]
        for name, chunk in (state.get("server_residuals") or {}).items():
            shape = torch.Size(shapes[name])
            offset, size, _ = cut(shape, place["per_node"])[place["position"]]
            sizes = chunk_sizes(size, place["nodes"])
            start = offset + sum(sizes[:place["cross_rank"]])
            target = full.setdefault(name, torch.zeros(shape.numel()))
            target[start:start + sizes[place["cross_rank"]]] = chunk.detach().cpu().reshape(-1).float()
    return full
