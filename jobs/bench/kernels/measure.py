"""Timing of every compressor's compress and decompress on one tensor: the rows of the
kernel benchmark, each with the exact wire size (``payload.nbytes``) and the dense size, plus
an exact ``torch.topk`` baseline ("torch_topk") and the memory system's page-fault cost."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from jobs.bench.report import eprint
from raycomp.compressors import make_compressor

__all__ = [
    "BASELINE", "DENSITY", "PARAMS", "SPARSIFIERS", "allocation_cost", "bench_compressor", "bench_torch_topk",
    "matrix_view", "run_benchmark", "timed",
]

DENSITY = 0.01
#: |z| >= 2.576 has probability 1% for z ~ N(0, 1)
THRESHOLD_1PCT = 2.576
POWERSGD_ROWS = 1024
BASELINE = "torch_topk"

#: non-default constructor parameters; compressors not listed use registry defaults
PARAMS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": DENSITY},
    "dgc_topk": {"ratio": DENSITY},
    "randomk": {"ratio": DENSITY},
    "threshold": {"threshold": THRESHOLD_1PCT},
    "powersgd": {"rank": 4},
}
#: compressors whose achieved density (kept / N) is recorded
SPARSIFIERS = ("topk", "dgc_topk", "randomk", "threshold", BASELINE)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], list[Any]]:
    """Run ``fn`` once to warm up, then ``repeats`` times; wall times and results."""
    fn()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    times, results = [], []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
            results.append(result)
    finally:
        if was_enabled:
            gc.enable()
    return times, results


def allocation_cost(numel: int, repeats: int) -> tuple[float, float]:
    """Median seconds to fill a *fresh* ``numel``-float tensor vs a reused one.

    The gap is the cost of faulting in new pages; glibc serves allocations above its mmap
    threshold (32 MiB at most) with fresh ``mmap``s, so every large temporary of a kernel pays
    it. It explains throughput that drops at large sizes.
    """
    buffer = torch.empty(numel)
    fresh, _ = timed(lambda: torch.empty(numel).fill_(1.0), max(repeats, 3))
    reused, _ = timed(lambda: buffer.fill_(1.0), max(repeats, 3))
    return statistics.median(fresh), statistics.median(reused)


def matrix_view(numel: int) -> tuple[int, int]:
    """(1024, N/1024) when 1024 divides N, else the divisor pair closest to square."""
    if numel % POWERSGD_ROWS == 0 and numel >= POWERSGD_ROWS:
        return POWERSGD_ROWS, numel // POWERSGD_ROWS
    rows = max(d for d in range(1, math.isqrt(numel) + 1) if numel % d == 0)
    return rows, numel // rows


def _rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    norm = torch.linalg.vector_norm(x).item()
    diff = torch.linalg.vector_norm(x - y.reshape(x.shape).to(x.dtype)).item()
    return diff / norm if norm > 0 else diff


def _row(
    name: str,
    x: torch.Tensor,
    compress_times: list[float],
    decompress_times: list[float],
    wire_bytes: int,
    dense_bytes: int,
    threads: int,
) -> dict[str, Any]:
    compress_s = statistics.median(compress_times)
    decompress_s = statistics.median(decompress_times)
    return {
        "compressor": name,
        "numel": x.numel(),
        "compress_s": compress_s,
        "decompress_s": decompress_s,
        "wire_bytes": int(wire_bytes),
        "dense_bytes": int(dense_bytes),
        "compress_gbps": dense_bytes / compress_s / 1e9,
        "decompress_gbps": dense_bytes / decompress_s / 1e9,
        "compress_s_min": min(compress_times),
        "decompress_s_min": min(decompress_times),
        "threads": threads,
        "repeats": len(compress_times),
        "shape": list(x.shape),
    }


def bench_compressor(name: str, x: torch.Tensor, repeats: int, threads: int) -> dict[str, Any]:
    """One row: ``name`` (with :data:`PARAMS`) compressing and decompressing ``x``."""
    params = PARAMS.get(name, {})
    compressor = make_compressor(name, **params)
    if name == "powersgd":
        x = x.view(matrix_view(x.numel()))
    compress_times, payloads = timed(lambda: compressor.compress(x), repeats)
    payload = payloads[-1]
    decompress_times, outputs = timed(lambda: compressor.decompress(payload), repeats)
    row = _row(
        name,
        x,
        compress_times,
        decompress_times,
        payload.nbytes,
        payload.dense_nbytes,
        threads,
    )
    row["params"] = compressor.params()
    if name in SPARSIFIERS:
        kept = [p.tensors["values"].numel() for p in payloads]
        row["density"] = statistics.median(kept) / x.numel()
        row["density_min"] = min(kept) / x.numel()
        row["density_max"] = max(kept) / x.numel()
    row["rel_error"] = _rel_error(x, outputs[-1])
    return row


def bench_torch_topk(x: torch.Tensor, repeats: int, threads: int) -> dict[str, Any]:
    """Exact top-k baseline: ``torch.topk(|x|, k)`` + gather; scatter into zeros."""
    n = x.numel()
    k = max(1, min(n, math.ceil(DENSITY * n)))

    def compress() -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.topk(x.abs(), k, sorted=False).indices
        return x[indices], indices

    compress_times, results = timed(compress, repeats)
    values, indices = results[-1]

    def decompress() -> torch.Tensor:
        return torch.zeros(n, dtype=x.dtype).scatter_(0, indices, values)

    decompress_times, outputs = timed(decompress, repeats)
    row = _row(
        BASELINE,
        x,
        compress_times,
        decompress_times,
        k * (4 + 4),  # fp32 values + int32 indices, as the topk payload
        n * x.element_size(),
        threads,
    )
    row["params"] = {"ratio": DENSITY, "sorted": False}
    row["density"] = row["density_min"] = row["density_max"] = k / n
    row["rel_error"] = _rel_error(x, outputs[-1])
    return row


def run_benchmark(
    sizes: Sequence[int], names: Sequence[str], repeats: int, threads: int, seed: int
) -> list[dict[str, Any]]:
    """Every compressor at every size on the same seeded input; the rows (an input modified in
    place is flagged)."""
    rows: list[dict[str, Any]] = []
    for numel in sizes:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(numel, generator=gen, dtype=torch.float32)
        reference = x.clone()
        for name in names:
            row = (
                bench_torch_topk(x, repeats, threads)
                if name == BASELINE
                else bench_compressor(name, x, repeats, threads)
            )
            if not torch.equal(x, reference):  # a compressor must not touch its input
                row["mutated_input"] = True
                eprint(f"WARNING: {name} modified its input tensor in place")
                x.copy_(reference)
            rows.append(row)
            eprint(
                f"{name:>10} n={numel:>10,}  compress {row['compress_s'] * 1e3:9.3f} ms  "
                f"decompress {row['decompress_s'] * 1e3:9.3f} ms  "
                f"ratio {row['dense_bytes'] / max(row['wire_bytes'], 1):8.1f}x"
            )
    return rows
