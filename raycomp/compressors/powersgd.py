"""PowerSGD: rank-r approximation by one step of power iteration, warm-started."""

from __future__ import annotations

from typing import Any

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, Cost, SeededDraws, Transport, check_int


class PowerSGD(Compressor):
    """Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019, Algorithm 1, on the matrix view ``M`` (first dim x rest):

        P = M Q              -> all-reduce mean
        P^ = ORTHOGONALIZE(P)
        Q = M^T P^           -> all-reduce mean
        return P^ Q^T        (Q kept to warm-start the next step)

    The steps are methods (:meth:`project`, :meth:`orthogonalize`, :meth:`back_project`,
    :meth:`remember`) so ``raycomp._internal.transports`` can put the two all-reduces between them;
    :meth:`compress` runs them locally. ``Q`` starts from a seed shared by all ranks.
    Gram-Schmidt skips columns whose norm is below ``epsilon`` (they become zero) instead of
    dividing by ~0. Wire: ``(rows + cols) * r`` fp32.
    """

    name = "powersgd"
    transport = Transport.LOWRANK
    shared_randomness = True
    cost = Cost(near_lossless=False, rounds=2)  # P and Q, each all-reduced

    def __init__(
        self, rank: int = 1, warm_start: bool = True, epsilon: float = 1e-8, seed: int = 0
    ) -> None:
        self.rank = check_int("rank", rank, 1)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start: expected true or false, got {warm_start!r}")
        self.warm_start = warm_start
        self.epsilon = float(epsilon)
        self._draws = SeededDraws(seed)
        self._q: torch.Tensor | None = None

    def params(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "warm_start": self.warm_start,
            "epsilon": self.epsilon,
            "seed": self._draws.seed,
        }

    @staticmethod
    def matrix_shape(shape: torch.Size) -> tuple[int, int]:
        rows = int(shape[0])
        return rows, (int(torch.Size(shape).numel()) // rows if rows else 0)

    def payload_bytes(self, numel: int, shape: tuple[int, ...], element_size: float) -> float:
        rows, cols = self.matrix_shape(torch.Size(shape))
        return 4 * (rows + cols) * min(self.rank, rows, cols)  # fp32 factors

    def effective_rank(self, shape: torch.Size) -> int:
        return min(self.rank, *self.matrix_shape(shape))

    def accepts(self, shape: torch.Size) -> bool:
        # like torch's powerSGD_hook: vectors and shapes where factors are not smaller go dense
        if len(shape) < 2:
            return False
        rows, cols = self.matrix_shape(shape)
        return (rows + cols) * self.effective_rank(shape) < rows * cols

    # --- the algorithm's steps -------------------------------------------------------
    def project(self, matrix: torch.Tensor) -> torch.Tensor:
        rows, cols = matrix.shape
        r = min(self.rank, rows, cols)
        if self._q is None or not self.warm_start or self._q.shape != (cols, r):
            gen = self._draws.generator(matrix.device)
            self._q = torch.randn(cols, r, generator=gen, device=matrix.device)
        else:
            # a warm start restored from a checkpoint loaded on another device (e.g. with
            # map_location="cpu") follows the gradient
            self._q = self._q.to(device=matrix.device, dtype=torch.float32)
            # a zero column would stay zero forever (M @ 0 = 0), e.g. after an all-zero
            # gradient: redraw such columns, keep the others warm
            dead = ~self._q.any(dim=0)
            # Asking whether any column is dead is a device-to-host wait on an accelerator (one per
            # layer and step), so there fresh columns are drawn every step and selected on
            # the device. Every rank draws the same, so the factors stay identical.
            if not self._branch_free(matrix.device) and not bool(dead.any()):
                return matrix @ self._q
            gen = self._draws.generator(matrix.device)
            fresh = torch.randn(cols, r, generator=gen, device=matrix.device)
            self._q = torch.where(dead, fresh, self._q)
        return matrix @ self._q

    @staticmethod
    def _branch_free(device: torch.device) -> bool:
        """Avoid data-dependent Python branches: everywhere but on the CPU each waits for the device."""
        return device.type != "cpu"

    def orthogonalize(self, p: torch.Tensor) -> torch.Tensor:
        """Modified Gram-Schmidt on the columns, in place; near-zero columns become zero."""
        for i in range(p.shape[1]):
            column = p[:, i]
            if i:  # project out earlier columns again: for a (nearly) dependent column one pass
                # leaves rounding noise along them, which normalising would blow up to O(1)
                done = p[:, :i]
                column.sub_(done @ (done.T @ column))
            norm = torch.linalg.vector_norm(column)
            # decided on the device (`if norm > epsilon` would wait for the GPU once per column):
            # dividing by infinity zeroes a near-zero column
            column.div_(torch.where(norm > self.epsilon, norm, torch.inf))
            if i + 1 < p.shape[1]:
                rest = p[:, i + 1 :]
                rest.sub_(torch.outer(column, column @ rest))
        return p

    def back_project(self, matrix: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
        # (P^T M)^T reads M row-major, several times faster than M^T @ P on CPU
        return (p_hat.T @ matrix).T

    def remember(self, q: torch.Tensor) -> None:
        self._q = q.clone() if self.warm_start else None

    # --- the local (single-process) view ----------------------------------------------
    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        matrix = flat.float().reshape(self.matrix_shape(shape))
        p = self.orthogonalize(self.project(matrix))
        q = self.back_project(matrix, p)
        self.remember(q)
        return Payload({"p": p, "q": q}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        p, q = payload.tensors["p"], payload.tensors["q"]
        return (p @ q.T).to(payload.dtype).reshape(payload.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"q": None if self._q is None else self._q.clone(), "draws": self._draws.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._q = None if state["q"] is None else state["q"].clone()
        self._draws.load_state_dict(state["draws"])
