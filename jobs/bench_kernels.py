"""Compression kernel micro-benchmark: compress / decompress time and wire size.

For every registered compressor (plus an exact ``torch.topk`` baseline, "torch_topk") and
every tensor size, a float32 tensor of standard-normal values (fixed seed) is compressed and
decompressed; the median wall time of ``--repeats`` runs after one warm-up is recorded,
with the exact wire size (``payload.nbytes``) and the dense size.

Parameters: ratio 0.01 for topk / dgc_topk / randomk / torch_topk; ``threshold`` = 2.576
(P(|z| >= 2.576) = 1% for z ~ N(0, 1)); powersgd rank 4 on a (1024, N/1024) matrix view;
registry defaults for the rest. ``--threads`` (default 1) fixes torch's intra-op threads,
so the figures are per core unless raised.

Output: ``<output-dir>/kernels.json`` (a JSON list of rows) and ``kernels.md``.
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from jobs._report import (
    command_line,
    eprint,
    machine_info,
    machine_markdown,
    markdown_table,
    write_results,
)
from raycomp.compressors import COMPRESSORS, make_compressor

HELP = "compress/decompress time and wire bytes of every compressor"

NAME = "kernels"
DEFAULT_SIZES = "1M,4M,16M"
QUICK_SIZES = "64K"
DEFAULT_REPEATS = 5
QUICK_REPEATS = 1
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

# targets checked in the "Targets" section
TARGET_SPEEDUP = 3.0
TARGET_DENSITY_TOL = 0.10
TARGET_GBPS_PER_CORE = 1.0
TARGET_NUMEL = 16 * 2**20

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


# --- argument parsing -------------------------------------------------------------------
def parse_size(text: str) -> int:
    match = _SIZE_RE.match(text)
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid size {text.strip()!r}: expected a positive element count such as "
            "65536, 64K, 1M or 16M (K/M/G are powers of 1024)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            f"invalid size list {text!r}: expected comma-separated sizes such as 1M,4M,16M"
        )
    return list(dict.fromkeys(parse_size(p) for p in parts))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer")
    return value


def parse_compressors(text: str) -> list[str]:
    allowed = [*COMPRESSORS, BASELINE]
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"invalid compressor {unknown[0] if unknown else text!r}; allowed: {', '.join(allowed)}"
        )
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help=f"comma-separated float32 element counts, K/M/G = 2^10/2^20/2^30 "
        f"(default {DEFAULT_SIZES}; {QUICK_SIZES} with --quick)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help=f"timed runs per measurement, median reported, after one warm-up "
        f"(default {DEFAULT_REPEATS}; {QUICK_REPEATS} with --quick)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch intra-op threads (default 1: per-core figures)",
    )
    parser.add_argument(
        "--compressors",
        type=parse_compressors,
        default=None,
        help=f"comma-separated subset to run (default: all registered + {BASELINE})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the input data (default 0)")
    parser.add_argument(
        "--output-dir",
        default="docs/benchmarks",
        help="where kernels.json and kernels.md are written (default docs/benchmarks)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: sizes {QUICK_SIZES} and {QUICK_REPEATS} repeat unless given",
    )


# --- measurement ------------------------------------------------------------------------
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


# --- report -----------------------------------------------------------------------------
def _size_label(numel: int) -> str:
    for unit, factor in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if numel % factor == 0:
            return f"{numel // factor}{unit}"
    return str(numel)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def targets_markdown(rows: Sequence[dict[str, Any]], threads: int) -> str:
    by_key = {(r["compressor"], r["numel"]): r for r in rows}
    sizes = sorted({r["numel"] for r in rows})
    lines = ["## Targets", ""]

    # 1. DGC sampled top-k vs exact torch.topk
    both = [n for n in sizes if ("dgc_topk", n) in by_key and (BASELINE, n) in by_key]
    if both:
        n = TARGET_NUMEL if TARGET_NUMEL in both else both[-1]
        dgc, ref = by_key[("dgc_topk", n)], by_key[(BASELINE, n)]
        speedup = ref["compress_s"] / dgc["compress_s"]
        deviation = dgc["density"] / DENSITY - 1
        where = f"{_size_label(n)} elements" + (
            ""
            if n == TARGET_NUMEL
            else f" (largest measured; target is at {_size_label(TARGET_NUMEL)})"
        )
        lines += [
            f"- **dgc_topk vs torch_topk speed-up at {where}**: "
            f"{ref['compress_s'] * 1e3:.2f} ms / {dgc['compress_s'] * 1e3:.2f} ms = "
            f"**{speedup:.2f}x** (target >= {TARGET_SPEEDUP:g}x): **{_verdict(speedup >= TARGET_SPEEDUP)}**",
            f"- **dgc_topk density at {where}**: {dgc['density'] * 100:.3f}% "
            f"(range over runs {dgc['density_min'] * 100:.3f}-{dgc['density_max'] * 100:.3f}%), "
            f"{deviation * 100:+.1f}% vs the {DENSITY * 100:g}% target "
            f"(target within +-{TARGET_DENSITY_TOL * 100:g}%): "
            f"**{_verdict(abs(deviation) <= TARGET_DENSITY_TOL + 1e-12)}**",
        ]
        others = [
            f"{_size_label(m)}: {by_key[(BASELINE, m)]['compress_s'] / by_key[('dgc_topk', m)]['compress_s']:.2f}x"
            for m in both
        ]
        lines.append(f"- speed-up at every size: {', '.join(others)}")
        lines.append(
            f"- robustness check at {_size_label(n)}, fastest run of each instead of the median: "
            f"{ref['compress_s_min'] * 1e3:.2f} ms / {dgc['compress_s_min'] * 1e3:.2f} ms = "
            f"{ref['compress_s_min'] / dgc['compress_s_min']:.2f}x"
        )
    else:
        lines.append("- dgc_topk vs torch_topk: not measured (both must be in --compressors)")

    # 2. 1-bit and 8-bit quantizer throughput per core
    for name in ("sign", "int8"):
        measured = [by_key[(name, n)] for n in sizes if (name, n) in by_key]
        if not measured:
            lines.append(f"- {name}: not measured")
            continue
        per_core = [r["compress_gbps"] / threads for r in measured]
        worst = min(per_core)
        detail = ", ".join(
            f"{_size_label(r['numel'])}: {g:.2f}" for r, g in zip(measured, per_core, strict=True)
        )
        per_core_note = (
            "" if threads == 1 else f"; measured with {threads} threads, divided by {threads}"
        )
        lines.append(
            f"- **{name} compress throughput** (GB/s of fp32 input per core{per_core_note}): "
            f"{detail}; worst **{worst:.2f} GB/s** (target >= {TARGET_GBPS_PER_CORE:g} GB/s "
            f"per core at every size): **{_verdict(worst >= TARGET_GBPS_PER_CORE)}**"
        )
    return "\n".join(lines)


def render_markdown(
    rows: Sequence[dict[str, Any]],
    command: str,
    info: dict[str, Any],
    sizes: Sequence[int],
    repeats: int,
    seed: int,
    alloc: dict[int, tuple[float, float]] | None = None,
) -> str:
    threads = info["torch_threads"]
    table = markdown_table(
        [
            "compressor",
            "numel",
            "compress ms",
            "decompress ms",
            "wire bytes",
            "ratio dense/wire",
            "compress GB/s",
        ],
        [
            [
                r["compressor"],
                f"{r['numel']:,}",
                f"{r['compress_s'] * 1e3:.3f}",
                f"{r['decompress_s'] * 1e3:.3f}",
                f"{r['wire_bytes']:,}",
                f"{r['dense_bytes'] / r['wire_bytes']:.1f}" if r["wire_bytes"] else "inf",
                f"{r['compress_gbps']:.2f}",
            ]
            for r in rows
        ],
        align="lrrrrrr",
    )
    params = sorted({(r["compressor"], repr(r.get("params", {}))) for r in rows})
    mutated = sorted({r["compressor"] for r in rows if r.get("mutated_input")})
    parts = [
        "# Compression kernel benchmark",
        "",
        "Generated by `jobs/bench_kernels.py`; raw rows in `kernels.json`.",
        "",
        "## Command",
        "",
        f"```\n{command}\n```",
        "",
        "## Machine",
        "",
        machine_markdown(info),
        "",
        "## Method",
        "",
        f"- Input: float32, standard normal, seed {seed}; sizes "
        f"{', '.join(f'{_size_label(n)} ({n:,})' for n in sizes)} elements.",
        f"- Times: median of {repeats} run(s) after one warm-up, wall clock "
        f"(`time.perf_counter`), {threads} torch thread(s). Decompress is timed on the last "
        "compress payload.",
        "- Wire bytes: `payload.nbytes` (exactly what a collective transmits); "
        "ratio = dense bytes / wire bytes; compress GB/s = dense fp32 bytes / compress time.",
        f"- `{BASELINE}`: `torch.topk(x.abs(), k, sorted=False)` + gather of the signed values; "
        "decompress = `scatter_` into a zero tensor; wire = k * (4 + 4) bytes.",
        "- powersgd (rank 4, warm-started across runs as in training) runs on the matrix view "
        + ", ".join(f"{r} x {c}" for r, c in (matrix_view(n) for n in sizes))
        + " (1024 rows; the divisor pair closest to square when 1024 does not divide N).",
        "- Parameters: "
        + "; ".join(f"{name} {p}" for name, p in params if p != "{}")
        + "; others at registry defaults.",
    ]
    if mutated:
        parts.append(f"- WARNING: these compressors modified their input: {', '.join(mutated)}")
    parts += ["", "## Results", "", table, "", targets_markdown(rows, threads), ""]
    if alloc:
        parts += [
            "## Memory-system calibration",
            "",
            "Filling a freshly allocated float32 tensor vs a reused one (the gap is page-fault "
            "cost; glibc `mmap`s every allocation above its threshold, at most 32 MiB, so "
            "kernels that create large temporaries pay it on every call):",
            "",
            markdown_table(
                ["numel", "fresh alloc + fill ms", "reused fill ms", "fresh GB/s", "reused GB/s"],
                [
                    [
                        f"{n:,}",
                        f"{fresh * 1e3:.3f}",
                        f"{reused * 1e3:.3f}",
                        f"{4 * n / fresh / 1e9:.2f}",
                        f"{4 * n / reused / 1e9:.2f}",
                    ]
                    for n, (fresh, reused) in sorted(alloc.items())
                ],
                align="rrrrr",
            ),
            "",
        ]
    return "\n".join(parts)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    sizes = args.sizes or parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    names = args.compressors or [*COMPRESSORS, BASELINE]
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    info = machine_info(threads)
    eprint(
        f"kernels: sizes {[_size_label(n) for n in sizes]}, {repeats} repeat(s), "
        f"{threads} thread(s), {len(names)} compressors"
    )
    alloc = {n: allocation_cost(n, repeats) for n in sizes}
    rows = run_benchmark(sizes, names, repeats, threads, args.seed)
    markdown = render_markdown(
        rows, command_line("jobs.bench", argv), info, sizes, repeats, args.seed, alloc
    )
    json_path, md_path = write_results(NAME, rows, markdown, args.output_dir)
    eprint(f"wrote {json_path} and {md_path}")
    return 0
