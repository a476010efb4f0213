"""A shaped-link report composed from phases, for budgets whose dense runs do not fit here.

A synchronous method's loss per step does not depend on the link, only its time per step does.
So where a method's whole run on the shaped link would take hours (dense at 2,000 steps), its
loss curve comes from a run on the unshaped link, and its time from a short run on the shaped
one: time to target = steps to target (curve) x the median step (shaped). Adaptive methods,
whose decisions depend on the link they measure, always run whole on the shaped link, against
the target the curves set (``--target`` fixed to it).

::

    python -m jobs.bench.e2e.compose --curves CURVES.json --steps-shaped STEPS.json \\
        --whole WHOLE.json [--whole ...] --output docs/benchmarks/e2e-lm-100mbit

Each input is the ``.json`` report of one phase (``python -m jobs.bench e2e ... --output-dir``):
``--curves`` the unshaped run that set the target (``--target auto``), ``--steps-shaped`` a
short run of the same methods on the shaped link (its step time, its NIC bytes per step and
its no-communication step), ``--whole`` the runs made whole on the shaped link.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobs.bench.report import markdown_table, write_atomic

__all__ = ["compose", "main", "render"]


def _methods(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["methods"]}


def _median(values: Sequence[float | None]) -> float | None:
    """The median over seeds, a miss counting as infinitely slow (None when most missed)."""
    ordered = sorted(float("inf") if v is None else v for v in values)
    if not ordered:
        return None
    mid = statistics.median(ordered)
    return None if mid == float("inf") else mid


def composed_row(name: str, curve: dict[str, Any], shaped: dict[str, Any]) -> dict[str, Any]:
    """A synchronous method's shaped-link row: its steps to target from ``curve`` (the
    unshaped run) times its median step on the shaped link, and its bytes per step."""
    step_s, per_step = shaped["step_s"], shaped["nic_bytes_per_step"]
    steps = curve["steps_to_target_seeds"]
    times = [None if s is None else s * step_s for s in steps]
    nic = [None if s is None else s * per_step for s in steps]
    return {"name": name, "how": "composed", "steps_to_target_seeds": steps, "steps_to_target": _median(steps),
            "step_s": step_s, "time_to_target_s_seeds": times, "time_to_target_s": _median(times),
            "nic_bytes_to_target_seeds": nic, "nic_bytes_to_target": _median(nic),
            "final_metric": curve["final_metric"], "final_metric_seeds": curve["final_metric_seeds"]}


def whole_row(row: dict[str, Any]) -> dict[str, Any]:
    """A method run whole on the shaped link, as its phase measured it."""
    nic = row["nic_bytes_to_stop_seeds"]
    reached = [s is not None for s in row["steps_to_target_seeds"]]
    return {"name": row["name"], "how": "whole", "steps_to_target_seeds": row["steps_to_target_seeds"],
            "steps_to_target": row["steps_to_target"], "step_s": row.get("step_s"),
            "time_to_target_s_seeds": row["time_to_target_s_seeds"], "time_to_target_s": row["time_to_target_s"],
            "nic_bytes_to_target_seeds": [b if ok else None for b, ok in zip(nic, reached, strict=True)],
            "nic_bytes_to_target": _median([b if ok else None for b, ok in zip(nic, reached, strict=True)]),
            "final_metric": row["final_metric"], "final_metric_seeds": row["final_metric_seeds"]}


def compose(curves: dict[str, Any], shaped: dict[str, Any], wholes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The composed results: every method of ``curves`` also stepped in ``shaped`` is composed,
    every method of ``wholes`` kept as measured; ratios against dense beside the compute bound."""
    target = curves["target"]
    for whole in wholes:
        if whole["target"]["value"] != target["value"]:
            raise ValueError(f"a whole run's target {whole['target']['value']} is not the curves' {target['value']}")
    steps_of = _methods(shaped)
    rows = [composed_row(n, r, steps_of[n]) for n, r in _methods(curves).items() if n in steps_of]
    rows += [whole_row(r) for whole in wholes for r in whole["methods"]]
    dense = next((r for r in rows if r["name"] == "dense"), None)
    bound = None
    if dense and dense["steps_to_target"] is not None and shaped.get("no_comm_step_s"):
        bound = dense["steps_to_target"] * shaped["no_comm_step_s"]
    for row in rows:
        row["speedup_vs_dense"] = _ratio(dense and dense["time_to_target_s"], row["time_to_target_s"])
        row["bytes_vs_dense"] = _ratio(dense and dense["nic_bytes_to_target"], row["nic_bytes_to_target"])
        row["over_compute_bound"] = _ratio(row["time_to_target_s"], bound)
    return {"workload": curves["workload"], "link": shaped["link"], "target": target,
            "seeds": curves["seeds"], "no_comm_step_s": shaped.get("no_comm_step_s"),
            "compute_bound_time_to_target_s": bound, "methods": rows,
            "phases": {"curves": curves.get("work_dir"), "steps_shaped": shaped.get("work_dir"),
                       "whole": [w.get("work_dir") for w in wholes]}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def _show(value: float | None, fmt: str) -> str:
    return "miss" if value is None else fmt.format(value)


def render(results: dict[str, Any]) -> str:
    """The composed report's table (medians over seeds) and how each row was measured."""
    rows = [[r["name"], r["how"], _show(r["steps_to_target"], "{:.0f}"), _show(r["time_to_target_s"], "{:.0f}"),
             _show(r["speedup_vs_dense"], "{:.2f}x"), _show(r["over_compute_bound"], "{:.2f}x"),
             _show(r["nic_bytes_to_target"] and r["nic_bytes_to_target"] / 1e6, "{:.0f}"),
             _show(r["bytes_vs_dense"], "{:.1f}x"), _show(r["final_metric"], "{:.4f}"),
             " / ".join(_show(s, "{:.0f}") for s in r["steps_to_target_seeds"])] for r in results["methods"]]
    head = ["method", "measured", "steps to target", "time to target s", "faster than dense", "x compute bound",
            "NIC MB to target", "fewer bytes than dense", "final val loss", "steps to target by seed"]
    return markdown_table(head, rows)


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.e2e.compose", description=__doc__.splitlines()[0])
    parser.add_argument("--curves", required=True, help="the unshaped phase's report (.json) that set the target")
    parser.add_argument("--steps-shaped", required=True, help="the short shaped phase's report (.json)")
    parser.add_argument("--whole", action="append", default=[], help="a phase run whole on the shaped link")
    parser.add_argument("--output", required=True, help="the composed report's path without extension")
    args = parser.parse_args(argv)
    results = compose(_load(args.curves), _load(args.steps_shaped), [_load(w) for w in args.whole])
    out = Path(args.output)
    write_atomic(out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
