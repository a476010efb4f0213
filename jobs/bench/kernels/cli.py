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
import re
from collections.abc import Sequence

import torch

from jobs.bench.kernels.measure import BASELINE, allocation_cost, run_benchmark
from jobs.bench.kernels.report import render_markdown, size_label
from jobs.bench.report import command_line, eprint, machine_info, write_results
from raycomp.compressors import COMPRESSORS

__all__ = ["HELP", "NAME", "add_arguments", "parse_compressors", "parse_size", "parse_sizes", "run"]

HELP = "compress/decompress time and wire bytes of every compressor"

NAME = "kernels"
DEFAULT_SIZES = "1M,4M,16M"
QUICK_SIZES = "64K"
DEFAULT_REPEATS = 5
QUICK_REPEATS = 1

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 (K/M/G are powers of 1024); a positive element count."""
    match = _SIZE_RE.match(text)
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid size {text.strip()!r}: expected a positive element count such as "
            "65536, 64K, 1M or 16M (K/M/G are powers of 1024)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated sizes, duplicates dropped, order kept."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            f"invalid size list {text!r}: expected comma-separated sizes such as 1M,4M,16M"
        )
    return list(dict.fromkeys(parse_size(p) for p in parts))


def positive_int(text: str) -> int:
    """A positive integer (``--repeats``, ``--threads``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer")
    return value


def parse_compressors(text: str) -> list[str]:
    """``--compressors``: registered names or ``torch_topk``, duplicates dropped."""
    allowed = [*COMPRESSORS, BASELINE]
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"invalid compressor {unknown[0] if unknown else text!r}; allowed: {', '.join(allowed)}"
        )
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m jobs.bench kernels``."""
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


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Time every compressor at every size, write ``kernels.json`` and ``kernels.md``; the exit status."""
    sizes = args.sizes or parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    names = args.compressors or [*COMPRESSORS, BASELINE]
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    info = machine_info(threads)
    eprint(
        f"kernels: sizes {[size_label(n) for n in sizes]}, {repeats} repeat(s), "
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
