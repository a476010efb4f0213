"""The sparse payload shared by all sparsifiers: values and their indices in the flattened tensor."""

from __future__ import annotations

import math

import torch

from raycomp._internal.wire.payload import Payload


def sparse_k(numel: int, ratio: float) -> int:
    """Number of elements kept at density ``ratio`` (at least one)."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    # int32 halves the index bytes; indices of 2**31 elements and more need int64
    return torch.int32 if numel <= 2**31 - 1 else torch.int64


def sparse_payload(
    flat: torch.Tensor, indices: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> Payload:
    return Payload(
        {"values": flat[indices], "indices": indices.to(index_dtype(flat.numel()))}, shape, dtype
    )


def scatter_dense(payload: Payload) -> torch.Tensor:
    values, indices = payload.tensors["values"], payload.tensors["indices"]
    out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
    out.index_put_((indices.long(),), values.to(payload.dtype), accumulate=True)
    return out.reshape(payload.shape)
