"""The kernel benchmark's markdown report: method, the table of rows, and the targets (DGC's
sampled top-k against exact ``torch.topk``; the 1- and 8-bit quantizers' throughput per core)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobs.bench.kernels.measure import BASELINE, DENSITY, matrix_view
from jobs.bench.report import machine_markdown, markdown_table

__all__ = ["render_markdown", "size_label", "targets_markdown"]

# targets checked in the "Targets" section
TARGET_SPEEDUP = 3.0
TARGET_DENSITY_TOL = 0.10
TARGET_GBPS_PER_CORE = 1.0
TARGET_NUMEL = 16 * 2**20


def size_label(numel: int) -> str:
    """65536 -> ``"64K"`` (the largest power-of-1024 unit that divides it)."""
    for unit, factor in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if numel % factor == 0:
            return f"{numel // factor}{unit}"
    return str(numel)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def targets_markdown(rows: Sequence[dict[str, Any]], threads: int) -> str:
    """The "Targets" section: each target's measured value and PASS/MISS."""
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
        where = f"{size_label(n)} elements" + (
            ""
            if n == TARGET_NUMEL
            else f" (largest measured; target is at {size_label(TARGET_NUMEL)})"
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
            f"{size_label(m)}: {by_key[(BASELINE, m)]['compress_s'] / by_key[('dgc_topk', m)]['compress_s']:.2f}x"
            for m in both
        ]
        lines.append(f"- speed-up at every size: {', '.join(others)}")
        lines.append(
            f"- robustness check at {size_label(n)}, fastest run of each instead of the median: "
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
            f"{size_label(r['numel'])}: {g:.2f}" for r, g in zip(measured, per_core, strict=True)
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
    """The markdown report: command, machine, method, the table, the targets, the allocation check."""
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
        "Generated by `jobs/bench/kernels/`; raw rows in `kernels.json`.",
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
        f"{', '.join(f'{size_label(n)} ({n:,})' for n in sizes)} elements.",
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
