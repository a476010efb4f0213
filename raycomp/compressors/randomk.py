"""Random-K sparsification with indices shared by all ranks."""

from __future__ import annotations

from typing import Any

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, SeededDraws, Transport, check_int, check_ratio
from raycomp.compressors.sparse import sparse_k


class RandomK(Compressor):
    """Keep ``k = ceil(ratio * N)`` uniformly random elements.

    Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed
    Optimization", NeurIPS 2018; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.

    The indices come from a generator seeded by ``(seed, draw)`` that every rank owns
    identically, so indices are never sent and the value vectors of all ranks are summed by
    all-reduce. Wire: ``k`` values. With ``scale=True`` values are multiplied by ``N/k``,
    which makes the estimate unbiased; with error feedback leave it off (Stich et al.).
    """

    name = "randomk"
    transport = Transport.ALLREDUCE
    sparse = True
    shared_randomness = True

    def __init__(self, ratio: float = 0.01, scale: bool = False, seed: int = 0) -> None:
        self.ratio = check_ratio("ratio", ratio)
        if not isinstance(scale, bool):
            raise ValueError(f"scale: expected true or false, got {scale!r}")
        self.scale = scale
        self.unbiased = scale
        self._draws = SeededDraws(check_int("seed", seed, 0))

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "scale": self.scale, "seed": self._draws.seed}

    def _indices(self, numel: int, device: torch.device) -> torch.Tensor:
        k = sparse_k(numel, self.ratio)
        gen = self._draws.generator(device)
        if 4 * k > numel:
            return torch.randperm(numel, generator=gen, device=device)[:k]
        # k << N: a full randperm(N) would cost O(N). Draw with replacement and keep the
        # first k distinct values in draw order, which is a uniform k-subset (sequential
        # sampling without replacement). 2k draws miss k distinct ones with negligible
        # probability for k <= N/4; then fall back to randperm (still deterministic).
        draws = torch.randint(0, numel, (2 * k,), generator=gen, device=device)
        distinct, inverse = torch.unique(draws, return_inverse=True)
        if distinct.numel() < k:
            return torch.randperm(numel, generator=gen, device=device)[:k]
        order = torch.arange(draws.numel(), device=device)
        first = torch.full_like(distinct, draws.numel()).scatter_reduce_(0, inverse, order, "amin")
        return distinct[first.argsort()[:k]]

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        indices = self._indices(flat.numel(), flat.device)
        values = flat[indices]
        if self.scale:
            values = values * (flat.numel() / indices.numel())
        # indices stay local: every rank regenerates them, they are not on the wire
        return Payload({"values": values}, shape, dtype, meta={"indices": indices})

    def decompress(self, payload: Payload) -> torch.Tensor:
        values = payload.tensors["values"]
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
        out[payload.meta["indices"]] = values.to(payload.dtype)
        return out.reshape(payload.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._draws.load_state_dict(state["draws"])
