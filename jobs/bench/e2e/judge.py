"""Judges a results dict against the goals table (:mod:`jobs.bench.e2e.goals`).

:data:`MEASURES` are the numbers a goal can read, each from the medians over seeds of
``raycomp_adaptive`` and the other methods; :func:`judge` picks the report's scope, reads each
of its goals' measure, compares it with the threshold and says PASS (``ok``) or MISS.
:func:`warmup_ceilings` gives the best values the benchmark's rules allow, printed beside the
goals that name one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.bench.e2e.goals import GOALS, SCOPES, Goal
from jobs.bench.e2e.stats import median_with_misses, ratio

__all__ = ["COMPARISONS", "MEASURES", "Measure", "judge", "scope_of", "warmup_ceilings"]


@dataclass(frozen=True)
class Measure:
    """A goal's number; ``note`` says why a goal without one is judged a PASS anyway (its
    number would be infinite); ``reference`` names what a ratio divides by, for the text."""

    value: float | None
    note: str | None = None
    reference: str = ""


@dataclass(frozen=True)
class _Rows:
    """The results and the rows a measure reads: adaptive, dense, the fastest other method."""

    results: dict[str, Any]
    by: dict[str, dict[str, Any]]
    ada: dict[str, Any]
    dense: dict[str, Any]
    best: dict[str, Any] | None

    @property
    def time(self) -> float | None:
        return self.ada["time_to_target_s"]


def _speedup_vs_dense(r: _Rows) -> Measure:
    return Measure(ratio(r.dense.get("time_to_target_s"), r.time))


def _time_vs_best_other(r: _Rows) -> Measure:
    return Measure(ratio(r.time, r.best["time_to_target_s"] if r.best else None))


def _speedup_vs_torch_powersgd(r: _Rows) -> Measure:
    ranks = [r.by[n]["time_to_target_s"] for n in r.by if n.startswith("torch_powersgd")]
    reached = [v for v in ranks if v is not None]
    if ranks and not reached and r.time is not None:  # a miss counts as infinitely slow, as in the medians
        return Measure(None, note=f"none of the {len(ranks)} torch powerSGD ranks run reached the target "
                                  "within the step budget; adaptive did")
    return Measure(ratio(min(reached), r.time) if reached else None)


def _final_metric_vs_dense(r: _Rows) -> Measure:
    """Adaptive's final metric relative to dense's, > 0 when adaptive is worse."""
    lower = r.results["target"]["lower_is_better"]
    rel = None
    if r.ada["final_metric"] is not None and r.dense.get("final_metric"):
        rel = (r.ada["final_metric"] - r.dense["final_metric"]) / abs(r.dense["final_metric"])
        rel = rel if lower else -rel
    return Measure(rel)


def _nic_reduction_vs_dense(r: _Rows) -> Measure:
    return Measure(ratio(r.dense.get("nic_bytes_per_step"), r.ada["nic_bytes_per_step"]))


def _step_vs_reference(r: _Rows) -> Measure:
    """Adaptive's steady step over each seed's own no-communication step, or over the
    compute-only step in a report from before the no-communication runs."""
    if r.results.get("no_comm_step_s"):
        return Measure(r.ada.get("step_vs_no_comm"), reference="the step without communication "
                       "(2 workers, torch's noop_hook; each seed's own)")
    return Measure(ratio(r.ada["step_s"], r.results["compute_step_s"]), reference="the compute-only step")


def _control_share(r: _Rows) -> Measure:
    return Measure(r.ada["control_share"])


#: measure name (a goal's ``measure``) -> how it reads the results
MEASURES: dict[str, Callable[[_Rows], Measure]] = {
    "speedup_vs_dense": _speedup_vs_dense,
    "time_vs_best_other": _time_vs_best_other,
    "speedup_vs_torch_powersgd": _speedup_vs_torch_powersgd,
    "final_metric_vs_dense": _final_metric_vs_dense,
    "nic_reduction_vs_dense": _nic_reduction_vs_dense,
    "step_vs_reference": _step_vs_reference,
    "control_share": _control_share,
}
#: a goal's ``comparison`` -> (value, threshold) -> pass
COMPARISONS: dict[str, Callable[[float, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "present": lambda value, threshold: True,
}


def scope_of(results: dict[str, Any]) -> str:
    """The first scope of :data:`~jobs.bench.e2e.goals.SCOPES` whose conditions ``results`` meets."""
    fields = {"strategy": results.get("strategy") or "ddp", "link": results.get("link", {}).get("rate"),
              "workload": results.get("workload", {}).get("name")}
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
    ceilings: dict[str, float | None] = {}
    out = []
    for goal in GOALS:
        if goal.scope != scope or (goal.needs and goal.needs not in by):
            continue
        measure = MEASURES[goal.measure](rows)
        if goal.ceiling and not ceilings:
            ceilings = warmup_ceilings(results, rows.dense)
        out.append(_verdict(goal, measure, rows, ceilings.get(goal.ceiling or "")))
    return out


def _verdict(goal: Goal, measure: Measure, rows: _Rows, ceiling: float | None) -> dict[str, Any]:
    value = measure.value
    ok = COMPARISONS[goal.comparison](value, goal.threshold) if value is not None else measure.note is not None
    text = goal.text.format(
        threshold=goal.threshold, margin=None if goal.threshold is None else goal.threshold - 1,
        best=f" ({rows.best['name']})" if rows.best else "", reference=measure.reference,
        metric=rows.results.get("target", {}).get("metric"))
    return {"goal": text, "value": value, "ok": bool(ok),
            **({"note": measure.note} if measure.note else {}), **({"ceiling": ceiling} if ceiling is not None else {})}


def warmup_ceilings(results: dict[str, Any], dense: dict[str, Any]) -> dict[str, float | None]:
    """The best ratios against dense that any method could reach under this benchmark's rules.

    Every method runs the same dense warm-up (steps 0 to ``warmup - 1``), so it pays dense's
    bytes and dense's step time there, whatever it does afterwards. With communication free
    from then on:

    * ``nic``: dense's NIC bytes over the window the benchmark counts (steps 1 to the last)
      divided by the warm-up's share of them: ``(steps - 1) / (warmup - 1)``;
    * ``vs_dense``: dense's time to target divided by the time of a run that reaches the target
      at dense's (median) step, paying dense's step time in the warm-up and only the
      no-communication step after it (the compute-only step in a report without one).

    None where the results lack a number it needs. A goal above its ceiling cannot pass by
    any change of policy: only a shorter warm-up, a longer budget or a looser target could.
    """
    wl = results.get("workload", {})
    steps, warmup = wl.get("steps"), wl.get("warmup_steps")
    nic = (steps - 1) / (warmup - 1) if steps and warmup and warmup > 1 else None
    hit = median_with_misses(dense.get("steps_to_target_seeds") or [])
    ttt, dense_step = dense.get("time_to_target_s"), dense.get("step_s")
    compute = results.get("no_comm_step_s") or results.get("compute_step_s")
    vs_dense = None
    if None not in (hit, ttt, dense_step, compute, warmup) and hit >= warmup:
        vs_dense = ttt / ((warmup - 1) * dense_step + (hit - warmup + 1) * compute)
    return {"nic": nic, "vs_dense": vs_dense}
