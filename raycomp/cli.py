"""The ``raycomp`` console command.

::

    raycomp inspect RUN          # a finished (or running) run: plan timeline with reasons, bytes, fallbacks
    raycomp plot RUN [--out F]   # the same run as a picture
    raycomp dashboard --out DIR  # the Grafana dashboard and Prometheus files for raycomp's metrics
    raycomp config [--markdown]  # every configuration field with its default and meaning
    raycomp --version            # the installed raycomp's version

``plot`` needs matplotlib: ``pip install "raycomp[plot]"``. Output into a pipe closed early
(``raycomp inspect RUN | head``) ends quietly, with exit 0.

Each subcommand lives in the module that holds its idea; this file only parses arguments
and dispatches, importing the subcommand's module only when it runs (so ``raycomp config``
and ``raycomp inspect`` start without importing Ray).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def version() -> str:
    """The installed distribution's version (its metadata), or a word saying it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("raycomp")
    except PackageNotFoundError:
        return "unknown (raycomp is not installed as a package)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raycomp", description="Adaptive gradient compression on Ray Train.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="print a run's plan timeline with reasons, bytes, fallbacks, syncs")
    inspect.add_argument("run", help="the run's output directory (its summary.json and step logs), "
                                     "or a Ray Train storage path that holds one")
    plot = sub.add_parser("plot", help="draw a run's plan timeline, bytes and loss")
    plot.add_argument("run", help="as for inspect")
    plot.add_argument("--out", default=None, help="the picture's path (default: <run>/raycomp.png)")
    dashboard = sub.add_parser("dashboard", help="write the Grafana dashboard and Prometheus files")
    dashboard.add_argument("--out", required=True, help="the directory to write them into")
    config = sub.add_parser("config", help="print every configuration field with its default and meaning")
    config.add_argument("--markdown", action="store_true", help="the reference as Markdown (docs/configuration.md)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _dispatch(_parser().parse_args(argv))
        sys.stdout.flush()  # here, not at exit: a closed pipe is noticed where it is handled
    except BrokenPipeError:
        # the reader stopped reading (``| head``): what it wanted it has. Point stdout at
        # /dev/null so that the interpreter's own flush at exit finds no pipe to complain of
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    return code


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        from raycomp._internal.observe import run_report
        return run_report.main(args)
    if args.command == "plot":
        from raycomp._internal.observe import run_plot
        return run_plot.main(args)
    if args.command == "dashboard":
        from raycomp._internal.observe import dashboard
        return dashboard.main(args)
    from raycomp.config import reference
    return reference.main(args)


if __name__ == "__main__":
    sys.exit(main())
