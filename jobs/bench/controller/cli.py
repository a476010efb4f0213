"""Controller load benchmark: many simulated ranks reporting to one controller actor.

A dedicated :class:`~raycomp.controllers.service.ControllerService` actor is created with
``get_or_create`` exactly as in production (snapshots on, Prometheus exporter on port 0
with a file-SD target list in a temporary directory). ``--runs`` runs are registered with
the ``critical`` policy (window ``WINDOW_STEPS`` steps, so decisions and plan changes
happen during the load), then ``--workers`` simulated ranks (spread evenly over the runs)
each send a valid ``GradStats`` report (``--layers`` layers with per-layer statistics,
step increasing by one per report) ``--rate`` times a second for ``--duration`` seconds.

Load generators are ``--generators`` Ray actors (``num_cpus=0``), each driving its share
of the ranks from one thread: report *k* of a rank is due at ``start + k / rate`` (plus a
fixed per-rank offset) and is submitted fire-and-forget, as real workers do, unless that
rank already has ``MAX_REPORTS_IN_FLIGHT`` reports unanswered: then, as a worker's session
does, it is dropped and counted. ``--open-loop`` never drops (the queue at an overloaded
controller then grows without bound). Ingest latency is the
round trip of every ``ingest.remote()`` call, from just before the submit to the moment
its ObjectRef resolves (timestamped in Ray's completion callback, so the generator's own
scheduling does not add to it).

While the load runs the driver samples the controller process (RSS and CPU time, via
``psutil`` on the actor's pid) and scrapes its ``/metrics`` endpoint a few times. After
the load it reads ``health()`` and every run's summary, then times the controller logic
in-process (no Ray) on a copy of the final snapshot: one full snapshot, one ingest.

Memory is *bounded* when the largest RSS sample of the second half of the load is less
than 10% above the RSS at its midpoint. Per-run histories hold ``HISTORY`` = 256 merged
steps, filled after 256 / rate seconds (25.6 s at 10/s), so a full-length run's second
half is past the point where a correct controller stops growing; a ``--quick`` run is not.

Output: ``<output-dir>/controller.json`` (a JSON list with one object: command, machine,
configuration, results, timelines) and ``controller.md``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.controller.load import run_load
from jobs.bench.controller.ranks import MAX_REPORTS_IN_FLIGHT
from jobs.bench.controller.report import render_markdown
from jobs.bench.report import command_line, eprint, machine_info, write_results

__all__ = ["DEFAULTS", "HELP", "NAME", "QUICK", "add_arguments", "run"]

HELP = "load test: simulated ranks reporting to one controller actor (latency, memory)"
NAME = "controller"
REPO = Path(__file__).resolve().parents[3]

DEFAULTS = {"workers": 64, "rate": 10.0, "duration": 60.0, "runs": 8}
QUICK = {"workers": 16, "rate": 10.0, "duration": 5.0, "runs": 4}


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive number")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m jobs.bench controller``."""
    q = QUICK
    parser.add_argument("--workers", type=_positive(int), default=None,
                        help=f"simulated ranks (default {DEFAULTS['workers']}; {q['workers']} with --quick)")
    parser.add_argument("--rate", type=_positive(float), default=None,
                        help=f"reports per second per rank (default {DEFAULTS['rate']:g})")
    parser.add_argument("--duration", type=_positive(float), default=None,
                        help=f"seconds of load (default {DEFAULTS['duration']:g}; {q['duration']:g} with --quick)")
    parser.add_argument("--runs", type=_positive(int), default=None,
                        help=f"registered runs the ranks are spread over (default {DEFAULTS['runs']}; "
                        f"{q['runs']} with --quick)")
    parser.add_argument("--layers", type=_positive(int), default=20,
                        help="layers per run, each reported by every rank (default 20)")
    parser.add_argument("--generators", type=_positive(int), default=4,
                        help="load-generator actors (num_cpus=0) the ranks are spread over (default 4)")
    parser.add_argument("--baseline", type=float, default=None, metavar="SECONDS",
                        help="then drive a no-op actor with the same load this long, for Ray's own "
                        "cost per call (default 10; 0 with --quick; 0 = off)")
    parser.add_argument("--open-loop", action="store_true",
                        help=f"submit every report even when a rank has {MAX_REPORTS_IN_FLIGHT} unanswered "
                        "(workers drop those; default: drop them like workers do)")
    parser.add_argument("--output-dir", default="docs/benchmarks",
                        help="where controller.json and controller.md are written (default docs/benchmarks)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {q['workers']} workers x {q['duration']:g} s, {q['runs']} runs "
                        "unless given")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start Ray if needed, run the load, write ``controller.json`` and ``controller.md``; the exit
    status."""
    import ray

    preset = QUICK if args.quick else DEFAULTS
    workers, rate = args.workers or preset["workers"], args.rate or preset["rate"]
    duration, runs = args.duration or preset["duration"], args.runs or preset["runs"]
    if runs > workers:
        eprint(f"error: --runs ({runs}) cannot exceed --workers ({workers})")
        return 2
    started = False
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
        started = True
    try:
        baseline = args.baseline if args.baseline is not None else (0.0 if args.quick else 10.0)
        res = run_load(workers, rate, duration, runs, args.layers, args.generators, baseline_s=baseline,
                       max_in_flight=None if args.open_loop else MAX_REPORTS_IN_FLIGHT)
    finally:
        if started:
            ray.shutdown()
    info = machine_info()
    command = command_line("jobs.bench", argv)
    row = {"benchmark": NAME, "command": command, "machine": info, **res}
    json_path, md_path = write_results(NAME, [row], render_markdown(res, command, info), args.output_dir)
    lat = res["latency"]
    eprint(f"sent {res['sent']:,} ({res['sent_rate']:.0f}/s of {res['target_rate']:.0f}), dropped {res['dropped']:,}, "
           f"rejected {res['rejected']}, p50 {lat['p50_ms']:.1f} ms p99 {lat['p99_ms']:.1f} ms, "
           f"RSS {res['rss']['start_mb']:.0f} -> {res['rss']['end_mb']:.0f} MB "
           f"({'bounded' if res['rss']['bounded'] else 'NOT bounded'})")
    eprint(f"wrote {json_path} and {md_path}")
    return 0
