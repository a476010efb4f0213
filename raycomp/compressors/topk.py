"""Top-K sparsification: exact, and DGC's sampled-threshold variant."""

from __future__ import annotations

import math
from typing import Any

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import (
    Compressor,
    Cost,
    SeededDraws,
    Transport,
    check_int,
    check_ratio,
)
from raycomp.compressors.sparse import scatter_dense, sparse_k, sparse_payload


class TopK(Compressor):
    """Keep the ``ratio`` fraction of elements of largest magnitude (exact ``torch.topk``).

    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
    with error feedback as in Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.

    Wire: ``k`` values (input dtype) + ``k`` int32 indices, ``k = ceil(ratio * N)``.
    """

    name = "topk"
    transport = Transport.ALLGATHER
    sparse = True
    cost = Cost(near_lossless=False, rounds=1)  # one all-gather

    def payload_bytes(self, numel: int, shape: tuple[int, ...], element_size: float) -> float:
        return sparse_k(numel, self.ratio) * (element_size + 4)  # values, int32 indices

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = check_ratio("ratio", ratio)

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        k = sparse_k(flat.numel(), self.ratio)
        indices = torch.topk(flat.abs(), k, sorted=False).indices
        return sparse_payload(flat, indices, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return scatter_dense(payload)


class SampledTopK(Compressor):
    """Top-K by a threshold estimated on a random sample (no full sort).

    Lin et al., "Deep Gradient Compression", ICLR 2018, Sec. 3 (sampling 0.1%-1% of the
    gradient to estimate the top-k threshold; hierarchical selection when too many pass):

    1. sample ``sample_ratio * N`` magnitudes; ``thr`` = their ``ceil(ratio * S * (1+margin))``-th
       largest (a slightly loose threshold so that at least ``k`` usually pass);
    2. select ``|x| >= thr``; if more than ``k`` pass, keep the exact top ``k`` of those;
    3. if fewer than ``(1 - tolerance) * k`` pass, lower the threshold and retry; after
       ``max_retries`` fall back to exact top-k.

    The kept count is within ``[(1 - tolerance) k, k]``, so payload sizes vary.
    """

    name = "dgc_topk"
    transport = Transport.ALLGATHER
    sparse = True
    variable_size = True
    _MARGIN = 0.1
    _MIN_SAMPLES = 256

    def __init__(
        self,
        ratio: float = 0.01,
        sample_ratio: float = 0.01,
        tolerance: float = 0.1,
        max_retries: int = 3,
        seed: int = 0,
    ) -> None:
        self.ratio = check_ratio("ratio", ratio)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)
        self.tolerance = check_ratio("tolerance", tolerance)
        self.max_retries = check_int("max_retries", max_retries, 0, 16)
        self._draws = SeededDraws(seed)

    def params(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "sample_ratio": self.sample_ratio,
            "tolerance": self.tolerance,
            "max_retries": self.max_retries,
            "seed": self._draws.seed,
        }

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        n = flat.numel()
        k = sparse_k(n, self.ratio)
        magnitudes = flat.abs()
        samples = max(self._MIN_SAMPLES, math.ceil(self.sample_ratio * n))
        if samples >= n // 2:  # small tensor: sampling saves nothing
            return sparse_payload(flat, torch.topk(magnitudes, k, sorted=False).indices, shape, dtype)
        gen = self._draws.generator(flat.device)
        sample = magnitudes[torch.randint(0, n, (samples,), generator=gen, device=flat.device)]
        density = self.ratio * (1 + self._MARGIN)
        for _ in range(self.max_retries + 1):
            rank_in_sample = min(samples, math.ceil(density * samples))
            threshold = torch.topk(sample, rank_in_sample, sorted=False).values.min()
            indices = torch.nonzero(magnitudes >= threshold).squeeze(1)
            if indices.numel() > k:
                keep = torch.topk(magnitudes[indices], k, sorted=False).indices
                indices = indices[keep]
            if indices.numel() >= (1 - self.tolerance) * k:
                return sparse_payload(flat, indices, shape, dtype)
            density *= 2
        return sparse_payload(flat, torch.topk(magnitudes, k, sorted=False).indices, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return scatter_dense(payload)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._draws.load_state_dict(state["draws"])
