"""``python -m jobs.projection``'s step model checked against the steps an end-to-end report measured.

    python -m jobs.projection_check docs/benchmarks/e2e-cnn-100mbit.json docs/benchmarks/e2e-cnn-4x1-100mbit.json

For each report it feeds the projection what the run measured -- W, the link's measured
rate, the step without communication as the compute, ``--round-ms`` and ``--decode-rate`` at
their defaults, as a user without a trace would -- and prints, as a markdown table, the step
it predicts against the step the run measured for two static plans every report holds:
dense (every layer fp32 through the ring) and ``raycomp_int4`` (int4 on every compressible
layer). It then runs the projection itself and prints the plan it settles on, with no
measurement beside it: the simulated ranks keep their gradients steady, so no layer turns
critical and the choice can differ from the run's (the adaptive run's own predictions are
scored in the report itself, ``plan_predictions``). A report without a method leaves its row
out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from jobs.bench.report import markdown_table
from jobs.projection import (
    MIN_COMPRESS_NUMEL,
    ROUND_MS,
    Setting,
    _workload,
    comm_seconds,
    default_decode_rate,
    layer_traffic,
    project,
)

__all__ = ["check", "main", "static_step"]

def static_step(shapes: dict[str, tuple[int, ...]], setting: Setting, compressor: str) -> float:
    """The projection's step (seconds) of a static plan: ``compressor`` on every layer of at
    least ``MIN_COMPRESS_NUMEL`` elements, dense on the rest."""
    wire, decoded, kinds = 0.0, 0.0, set()
    for shape in shapes.values():
        n = math.prod(shape)
        kind = compressor if n >= MIN_COMPRESS_NUMEL else "none"
        kinds.add(kind)
        sent, decodes = layer_traffic(kind, {}, n, shape, setting.workers)
        wire += sent
        decoded += decodes
    return setting.compute + comm_seconds(setting, wire, decoded, kinds)


def _method(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in report["methods"] if m["name"] == name), None)


def check(report: dict[str, Any]) -> list[list[Any]]:
    """Rows (report, W, plan, predicted ms, measured ms, error) of one end-to-end report."""
    config, w = report["workload"]["config"], int(report["workload"].get("world_size", 2))
    mbit, compute = report["link"]["measured_mbit_s"], report["no_comm_step_s"]
    shapes, lossy = _workload(config)
    setting = Setting(w, mbit * 1e6 / 8, compute, ROUND_MS / 1000, lossy, decode_rate=default_decode_rate()[0])
    label = f"{report['workload']['name']} {report.get('topology', '2x1')}"
    rows = []
    for method, compressor in (("dense", "none"), ("raycomp_int4", "int4")):
        measured = (_method(report, method) or {}).get("step_s")
        if measured:
            predicted = static_step(shapes, setting, compressor)
            rows.append([label, w, f"{method} (static)", predicted, measured])
    projected = project(shapes, setting)
    rows.append([label, w, f"the projection's choice (not run as such): {projected['reason']}",
                 projected["chosen_s"], None])
    return [[*r[:3], r[3] * 1e3, None if r[4] is None else r[4] * 1e3,
             None if r[4] is None else r[3] / r[4] - 1] for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.projection_check", description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="end-to-end report JSON files (docs/benchmarks/e2e-*.json)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.reports:
        try:
            report = json.loads(Path(path).read_text())
            rows += check(report)
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"python -m jobs.projection_check: {path}: {error}", file=sys.stderr)
            return 2
    print(markdown_table(["report", "W", "plan", "predicted ms", "measured ms", "error"],
                         [[r[0], r[1], r[2], f"{r[3]:.0f}", "—" if r[4] is None else f"{r[4]:.0f}",
                           "—" if r[5] is None else f"{r[5]:+.0%}"] for r in rows], align="lrlrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
