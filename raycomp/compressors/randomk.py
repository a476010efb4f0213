"""Random-K sparsification with indices shared by all ranks."""

from __future__ import annotations

from typing import Any

import torch

from raycomp.compressors.base import Compressor, SeededDraws, Transport, check_int, check_ratio
from raycomp.compressors.sparse import sparse_k
from raycomp.payload import Payload


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
        gen = self._draws.generator(device)
        return torch.randperm(numel, generator=gen, device=device)[: sparse_k(numel, self.ratio)]

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
