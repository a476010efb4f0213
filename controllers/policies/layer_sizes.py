"""A layer as the cost model sizes it: its matrix view (PowerSGD's factors), its pieces in
two levels (:func:`raycomp._internal.reduce.two_level.cut`), and its bytes per gradient
element as the ranks' dense bytes tell them."""

from __future__ import annotations

import math

import torch

from raycomp._internal.reduce.two_level import cut

from ..state import LayerHistory, RunState


def matrix(h: LayerHistory) -> tuple[int, int]:
    """PowerSGD's matrix view (first dim x rest); a square guess without a shape."""
    if h.shape is None:
        side = max(1, math.isqrt(h.numel))
        return side, max(1, h.numel // side)
    if len(h.shape) < 2:
        return 1, h.numel  # a vector: factors are never smaller
    return h.shape[0], h.numel // max(1, h.shape[0])


def piece(h: LayerHistory, parts: int) -> tuple[int, tuple[int, ...]]:
    """(elements, shape) of the largest of ``parts`` pieces of a layer, as
    :func:`raycomp._internal.reduce.two_level.cut` cuts it (whole rows where it can, else as one vector)."""
    if parts == 1:
        return h.numel, h.shape if h.shape is not None else matrix(h)
    _, size, shape = cut(torch.Size(h.shape if h.shape is not None else (h.numel,)), parts)[0]
    return size, tuple(shape)


def piece_on_nodes(run: RunState) -> float:
    """Times a rank's bytes count each element when it sends its 1/L piece of every layer
    on a ring of the K nodes: a two-level step's pieces, a model sharded per node's shards."""
    k = run.nodes
    return 2 * (k - 1) / k / run.per_node


def element_bytes(h: LayerHistory, world_size: int, allreduce: float, share: float = 1.0) -> float:
    """Bytes per gradient element from the measured dense bytes (the sum over the ranks of
    one step; ``share``: the part of the layer they counted), rounded to 2, 4 or 8; 4
    (fp32) before any measurement."""
    if h.dense_bytes <= 0 or not h.numel or allreduce <= 0:
        return 4.0
    return nearest_size(h.dense_bytes / (world_size * allreduce * h.numel * share))


def nearest_size(measured: float) -> float:
    """The element size (2, 4 or 8 bytes) nearest a measured bytes per element."""
    return min((2.0, 4.0, 8.0), key=lambda size: abs(size - measured))


__all__ = ["element_bytes", "matrix", "nearest_size", "piece", "piece_on_nodes"]
