"""Judges a results dict against the goals table (:mod:`jobs.bench.e2e.goals`).

:data:`MEASURES` are the numbers a goal can read, each from the medians over seeds of
``raycomp_adaptive`` and the other methods; :func:`judge` picks the report's scope, reads each
of its goals' measure, compares it with the threshold and says PASS (``ok``) or MISS. Beside
every time ratio stands its physical limit (``limit``): the value the ratio would take if
adaptive reached the target at the compute-bound time (dense's steps to target x the step
without communication, ``compute_bound_time_to_target_s``). A goal beyond its limit cannot
pass by any change of policy that keeps dense's steps to target.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.bench.e2e.goals import GOALS, LOCAL_METHODS, SCOPES, Goal
from jobs.bench.e2e.predictions import worst_error
from jobs.bench.e2e.stats import median, ratio

__all__ = ["COMPARISONS", "MEASURES", "Measure", "judge", "scope_of"]


@dataclass(frozen=True)
class Measure:
    """A goal's number; ``note`` says why a goal without one is judged a PASS anyway (its
    number would be infinite); ``limit`` is the best value the compute bound allows."""

    value: float | None
    note: str | None = None
    limit: float | None = None
    detail: str | None = None  # how the value was made (per seed), shown after the verdict


@dataclass(frozen=True)
class _Rows:
    """The results and the rows a measure reads: adaptive, dense, the fastest other method,
    the compute-bound time to target."""

    results: dict[str, Any]
    by: dict[str, dict[str, Any]]
    ada: dict[str, Any]
    dense: dict[str, Any]
    best: dict[str, Any] | None

    @property
    def time(self) -> float | None:
        return self.ada["time_to_target_s"]

    @property
    def bound(self) -> float | None:
        return self.results.get("compute_bound_time_to_target_s")


def _speedup_vs(r: _Rows, other: dict[str, Any] | None) -> Measure:
    t = (other or {}).get("time_to_target_s")
    return Measure(ratio(t, r.time), limit=ratio(t, r.bound))


def _speedup_vs_dense(r: _Rows) -> Measure:
    return _speedup_vs(r, r.dense)


def _speedup_vs_int4(r: _Rows) -> Measure:
    return _speedup_vs(r, r.by.get("raycomp_int4"))


def best_local(r: _Rows) -> dict[str, Any] | None:
    """The fastest local-step method that reached the target (None: none did)."""
    reached = [r.by[n] for n in LOCAL_METHODS if n in r.by and r.by[n]["time_to_target_s"] is not None]
    return min(reached, key=lambda m: m["time_to_target_s"], default=None)


def _speedup_vs_best_local(r: _Rows) -> Measure:
    best = best_local(r)
    ran = [n for n in LOCAL_METHODS if n in r.by]
    if best is None and ran and r.time is not None:  # a miss counts as infinitely slow, as in the medians
        return Measure(None, note=f"none of the local-step methods run ({', '.join(ran)}) reached the target "
                                  "within the step budget; adaptive did")
    return _speedup_vs(r, best)


def _time_vs_best_other(r: _Rows) -> Measure:
    t = r.best["time_to_target_s"] if r.best else None
    return Measure(ratio(r.time, t), limit=ratio(r.bound, t))


def _time_vs_compute_bound(r: _Rows) -> Measure:
    return Measure(ratio(r.time, r.bound), limit=1.0 if r.bound else None)


def _final_metric_vs_dense(r: _Rows) -> Measure:
    """Adaptive's validation metric relative to dense's at the same step, > 0 when adaptive
    is worse: per seed at the last evaluation both runs made, then the median over seeds.

    Not the two runs' last evaluations: a run stops once the target held twice, so a method
    that stops there ends near the target, dense's metric at the target step, while dense
    (with the auto target) runs its whole budget and ends lower; their finals differ by
    dense's own progress after the target step (1.1% on the character LSTM), whatever the
    method."""
    lower = r.results["target"]["lower_is_better"]

    def by_step(run: dict[str, Any]) -> dict[int, float]:
        return {e["step"]: e["value"] for e in run.get("curve") or []}

    dense = {run["seed"]: by_step(run) for run in r.dense.get("runs") or []}
    seen = []
    for run in r.ada.get("runs") or []:
        own, other = by_step(run), dense.get(run["seed"], {})
        both = [s for s in own if s in other and own[s] is not None and other[s]]
        if both:
            step = max(both)
            rel = (own[step] - other[step]) / abs(other[step])
            seen.append((run["seed"], step, rel if lower else -rel))
    if not seen:
        return Measure(None)
    return Measure(median([rel for _, _, rel in seen]),
                   detail="; ".join(f"seed {seed} at step {step}: {rel:+.2%}" for seed, step, rel in seen))


def _nic_reduction_vs_dense(r: _Rows) -> Measure:
    return Measure(ratio(r.dense.get("nic_bytes_to_stop"), r.ada.get("nic_bytes_to_stop")))


def _nic_per_step_reduction_vs_dense(r: _Rows) -> Measure:
    return Measure(ratio(r.dense.get("nic_bytes_per_step"), r.ada["nic_bytes_per_step"]))


def _time_vs_flat(r: _Rows) -> Measure:
    flat = (r.by.get("raycomp_adaptive_flat") or {}).get("time_to_target_s")
    return Measure(ratio(r.time, flat))


def _nic_per_step_flat_vs_levels(r: _Rows) -> Measure:
    flat, levels = r.by.get("raycomp_int4") or {}, r.by.get("raycomp_int4_levels") or {}
    return Measure(ratio(flat.get("nic_bytes_per_steady_step"), levels.get("nic_bytes_per_steady_step")))


def _prediction_error(r: _Rows) -> Measure:
    worst, detail = worst_error(r.ada.get("runs") or [])
    return Measure(worst, detail=detail)


#: measure name (a goal's ``measure``) -> how it reads the results
MEASURES: dict[str, Callable[[_Rows], Measure]] = {
    "speedup_vs_dense": _speedup_vs_dense,
    "speedup_vs_int4": _speedup_vs_int4,
    "speedup_vs_best_local": _speedup_vs_best_local,
    "time_vs_best_other": _time_vs_best_other,
    "time_vs_compute_bound": _time_vs_compute_bound,
    "final_metric_vs_dense": _final_metric_vs_dense,
    "nic_reduction_vs_dense": _nic_reduction_vs_dense,
    "nic_per_step_reduction_vs_dense": _nic_per_step_reduction_vs_dense,
    "prediction_error": _prediction_error,
    "time_vs_flat": _time_vs_flat,
    "nic_per_step_flat_vs_levels": _nic_per_step_flat_vs_levels,
}
#: a goal's ``comparison`` -> (value, threshold) -> pass
COMPARISONS: dict[str, Callable[[float, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "present": lambda value, threshold: True,
}


def scope_of(results: dict[str, Any]) -> str:
    """The first scope of :data:`~jobs.bench.e2e.goals.SCOPES` whose conditions ``results`` meets."""
    fields = {"strategy": results.get("strategy") or "ddp", "link": results.get("link", {}).get("rate"),
              "workload": results.get("workload", {}).get("name"),
              "ranks": "two" if results.get("workload", {}).get("world_size", 2) <= 2 else "many"}
    return next(name for name, when in SCOPES if all(fields[k] == v for k, v in when.items()))


def judge(results: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS/MISS of the goals of the report's scope on the medians over seeds (a missing number
    is a MISS); [] when ``raycomp_adaptive`` did not run."""
    by = {m["name"]: m for m in results["methods"]}
    ada = by.get("raycomp_adaptive")
    if not ada:
        return []
    others = [m for m in results["methods"] if m["name"] != "raycomp_adaptive"]
    best = min((m for m in others if m["time_to_target_s"] is not None),
               key=lambda m: m["time_to_target_s"], default=None)
    rows = _Rows(results, by, ada, by.get("dense") or {}, best)
    scope = scope_of(results)
    return [_verdict(goal, MEASURES[goal.measure](rows), rows) for goal in GOALS
            if goal.scope == scope and (not goal.needs or any(n in by for n in goal.needs))]


def _verdict(goal: Goal, measure: Measure, rows: _Rows) -> dict[str, Any]:
    value = measure.value
    ok = COMPARISONS[goal.comparison](value, goal.threshold) if value is not None else measure.note is not None
    local = best_local(rows)
    text = goal.text.format(
        threshold=goal.threshold, margin=None if goal.threshold is None else goal.threshold - 1,
        best=f" ({rows.best['name']})" if rows.best else "", best_local=f" ({local['name']})" if local else "",
        metric=rows.results.get("target", {}).get("metric"))
    return {"goal": text, "measure": goal.measure, "value": value, "ok": bool(ok),
            **({"note": measure.note} if measure.note else {}),
            **({"limit": measure.limit} if measure.limit is not None else {}),
            **({"detail": measure.detail} if measure.detail else {})}
