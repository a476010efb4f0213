"""Benchmark dispatcher: ``python -m jobs.bench <benchmark> [options]`` (``jobs/bench/__main__.py``).

Each benchmark lives in its own module that exposes

* ``HELP``: a one-line description;
* ``add_arguments(parser)``: registers its options on an ``argparse`` sub-parser;
* ``run(args, argv) -> int``: runs it (``argv`` is the command line after
  ``jobs.bench``, recorded in the report) and returns the exit status.

To add one, write its module (or a package with a ``cli`` module) under ``jobs/bench/`` and
add it to :data:`BENCHMARKS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["BENCHMARKS", "build_parser", "main"]

#: subcommand name -> module implementing it
BENCHMARKS: dict[str, str] = {
    "kernels": "jobs.bench.kernels.cli",
    "e2e": "jobs.bench.e2e.cli",
    "controller": "jobs.bench.controller.cli",
    "tune": "jobs.bench.tune",
    "outage": "jobs.bench.outage",
    "overhead": "jobs.bench.overhead.cli",
    "guard-error": "jobs.bench.guard_error",
}


def build_parser() -> argparse.ArgumentParser:
    """One sub-command per benchmark, each with its module's options."""
    parser = argparse.ArgumentParser(
        prog="python -m jobs.bench",
        description="raycomp benchmarks; results go to JSON + markdown reports.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark named on the command line; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return int(args._module.run(args, argv) or 0)
