"""QSGD: stochastic rounding of each magnitude, relative to its bucket's norm, to one of
``points`` quantization points."""

from __future__ import annotations

from typing import Any

import torch

from raycomp._internal.wire.bitpack import pack_bits, unpack_bits
from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, SeededDraws, Transport, check_int


class QSGD(Compressor):
    """Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding", NeurIPS 2017, Sec. 3.1, with ``s = points``:

        Q_s(x_i) = ||x||_2 * sign(x_i) * xi_i / s,
        xi_i = l + 1 with probability |x_i| / ||x||_2 * s - l, else l,  l = floor(|x_i| s / ||x||_2)

    which is unbiased. ``points`` is the paper's ``s``, which it calls the number of
    quantization levels: the nonzero magnitudes a value can round to, ``k / s`` of its
    bucket's norm for ``k = 1 .. s`` (zero besides). raycomp calls them points because
    "levels" names the two-level topology (``compression.levels``) and "steps" training steps.

    As in the paper's experiments the vector is quantized in buckets of ``bucket_size``
    elements, each with its own norm (variance ~ sqrt(bucket_size) / s instead of
    sqrt(N) / s). Each signed point ``k`` is stored as the code ``k + s`` in ``{0..2s}``,
    packed at 2, 4 or 8 bits (the smallest that holds ``2s + 1`` codes); the paper's Elias
    coding of the points is not used, so the size is fixed and known.
    Wire: ``ceil(N * bits / 8)`` bytes + one fp32 norm per bucket.
    """

    name = "qsgd"
    transport = Transport.SCALABLE
    unbiased = True

    def __init__(self, points: int = 7, bucket_size: int = 512, seed: int = 0) -> None:
        self.points = check_int("points", points, 1, 127)
        self.bucket_size = check_int("bucket_size", bucket_size, 1)
        self.bits = next(b for b in (2, 4, 8) if 2 * self.points + 1 <= 2**b)
        self._draws = SeededDraws(seed)

    def params(self) -> dict[str, Any]:
        return {"points": self.points, "bucket_size": self.bucket_size, "seed": self._draws.seed}

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        n = flat.numel()
        buckets = _pad(flat.float(), self.bucket_size).view(-1, self.bucket_size)
        norms = torch.linalg.vector_norm(buckets, dim=1, keepdim=True)
        scaled = buckets.abs() / torch.where(norms > 0, norms, 1.0) * self.points
        gen = self._draws.generator(flat.device)
        noise = torch.rand(buckets.shape, generator=gen, device=flat.device)
        point = (scaled + noise).floor_().clamp_(max=self.points)  # rounds up w.p. frac(scaled)
        codes = (point.copysign_(buckets) + self.points).to(torch.uint8).reshape(-1)[:n]
        return Payload(
            {"codes": pack_bits(codes, self.bits), "norms": norms.reshape(-1)}, shape, dtype
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = payload.numel
        codes = unpack_bits(payload.tensors["codes"], self.bits, n)
        points = _pad(codes.float() - self.points, self.bucket_size).view(-1, self.bucket_size)
        values = points * (payload.tensors["norms"] / self.points)[:, None]
        return values.reshape(-1)[:n].to(payload.dtype).reshape(payload.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._draws.load_state_dict(state["draws"])


def _pad(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-x.numel()) % multiple
    return torch.cat([x, x.new_zeros(extra)]) if extra else x
