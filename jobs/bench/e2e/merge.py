"""Several work directories of one benchmark, analysed as one report.

A full run with every grid on every seed takes longer than a sitting; the benchmark can be
run in phases instead (e.g. the grids on seed 0, then each grid's best setting on seeds 1
and 2, beside the runs that set the target), each phase in its own ``--work-dir``, and
``--reanalyze DIR DIR ...`` merges their raw traces. What the phases must share is checked:
the workload, its config, step budget, evaluation cadence, link, strategy and extra
overrides, and the target every run stopped at (the first directory's; a phase started with
``--target`` must name the value the first one's dense runs set, to the 4 decimals reports
print: within :data:`TARGET_TOLERANCE`).

A method and seed that a later directory ran again is taken from the later one (a method
re-run after a change of the code replaces its earlier runs), except the reference runs
every phase starts with (compute-only, and no communication per seed): those count from the
first directory that has them, so that every step is divided by figures of one sitting.
Phases run hours apart are comparable only as far as the machine's speed held; the report
lists every phase's command.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jobs.bench.e2e.methods import REFERENCES

__all__ = ["SHARED", "TARGET_TOLERANCE", "merge_work"]

#: relative difference allowed between the phases' stop targets (a target typed from a report)
TARGET_TOLERANCE = 1e-4
#: settings every phase must share
SHARED = ("workload", "config", "extra", "steps", "eval_every", "strategy", "link", "mode")


def _stop_target(raw: dict[str, Any], settings: dict[str, Any]) -> float | None:
    value = raw.get("stop_target", settings.get("target"))
    return None if value is None else float(value)


def merge_work(works: list[Path]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(raw, meta)`` of ``works`` merged, in their order (the first one's link check,
    machine and layers). Raises ValueError naming the setting two phases disagree on."""
    loaded = [(json.loads((w / "raw.json").read_text()), json.loads((w / "meta.json").read_text())) for w in works]
    (raw, meta), rest = loaded[0], loaded[1:]
    settings = dict(meta["settings"])
    target = _stop_target(raw, settings)
    runs = {(r["method"], r["seed"]): r for r in raw["runs"]}
    methods, seeds = list(settings["methods"]), list(settings["seeds"])
    idle, commands, seconds = list(raw["idle"]), [meta["command"]], [meta.get("benchmark_seconds")]
    for work, (other, other_meta) in zip(works[1:], rest, strict=True):
        theirs = other_meta["settings"]
        for key in SHARED:
            if theirs.get(key) != settings.get(key):
                raise ValueError(f"{work}: settings.{key} is {theirs.get(key)!r}, {works[0]} has {settings.get(key)!r}; "
                                 "merged phases must share it")
        stop = _stop_target(other, theirs)
        same = stop is None if target is None else stop is not None and math.isclose(stop, target,
                                                                                  rel_tol=TARGET_TOLERANCE)
        if not same:
            raise ValueError(f"{work}: its runs stopped at target {stop}, {works[0]}'s at {target}; "
                             "merged phases must stop at the same target")
        if other["layers"] != raw["layers"]:
            raise ValueError(f"{work}: a different model ({len(other['layers'])} layers); merged phases must share it")
        for r in other["runs"]:
            key = (r["method"], r["seed"])
            if r["method"] in REFERENCES and key in runs:
                continue  # the earlier directory's reference run stands
            runs.pop(key, None)  # a re-run replaces the earlier one, and goes where it ran
            runs[key] = r
        methods += [m for m in theirs["methods"] if m not in methods]
        seeds += [s for s in theirs["seeds"] if s not in seeds]
        idle += other["idle"]
        commands.append(other_meta["command"])
        seconds.append(other_meta.get("benchmark_seconds"))
    merged_raw = {**raw, "runs": list(runs.values()), "idle": idle}
    merged_meta = {**meta, "settings": {**settings, "methods": methods, "seeds": seeds},
                   "command": "\n".join(commands),
                   "benchmark_seconds": None if None in seconds else sum(seconds),
                   "phases": [str(w) for w in works]}
    return merged_raw, merged_meta
