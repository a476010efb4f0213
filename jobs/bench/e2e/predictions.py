"""The adaptive policy's predicted step against the step each plan measured.

Every plan the controller publishes carries its decision's facts (``plans.jsonl``, ``why``):
the adaptive chooser's predicted step of every candidate and the one it chose
(``predicted[shift]``), local steps' predicted seconds a step at the chosen H
(``local_step``) or per step (``per_step``). A plan is in force from the step after the one
it was published at to the next plan's; its measured step is the mean gap between step
records over that stretch, from one control interval in (a new plan reaches every rank
within a step or two, and the policy times an interval before it trusts it), evaluation
gaps excluded. A plan held for fewer than :data:`MIN_STEPS` such gaps is not scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobs.bench.e2e.traces import steady_step_s

__all__ = ["MIN_STEPS", "plan_predictions", "predicted_of", "worst_error"]

MIN_STEPS = 5


def predicted_of(why: dict[str, Any] | None) -> float | None:
    """The step (seconds) a decision predicted for the plan it chose; None where it priced none
    (a fixed schedule, a guard's fallback, a warm-up's dense plan before the link was timed)."""
    if not why:
        return None
    if isinstance(why.get("inner"), dict):  # the warm-up's own choice wraps the chooser's
        return predicted_of(why["inner"])
    if "local_step" in why:
        seconds = why["local_step"] if why.get("h") else why.get("per_step")
        return float(seconds) if seconds else None
    predicted, shift = why.get("predicted"), why.get("shift")
    if predicted and shift is not None and 0 <= shift < len(predicted):
        return float(predicted[shift])
    return None


def plan_predictions(plans: list[dict[str, Any]], steps: list[dict[str, Any]], eval_steps: Sequence[int],
                     interval: int) -> list[dict[str, Any]]:
    """Each priced plan of a run: the step it was published at, the steps it held, its
    predicted and measured step (seconds) and the error (predicted / measured - 1)."""
    events = sorted((p for p in plans if p.get("kind") in ("start", "plan")), key=lambda p: int(p["step"]))
    out = []
    for index, event in enumerate(events):
        predicted = predicted_of(event.get("why"))
        if predicted is None:
            continue
        begin = int(event["step"]) + 1 + interval
        end = int(events[index + 1]["step"]) if index + 1 < len(events) else None
        measured, gaps = steady_step_s(steps, eval_steps, begin + 1, end)
        if measured is None or gaps < MIN_STEPS:
            continue
        out.append({"step": int(event["step"]), "steps": gaps, "rule": (event.get("why") or {}).get("rule"),
                    "reason": event.get("reason"), "predicted_s": predicted, "measured_s": measured,
                    "error": predicted / measured - 1})
    return out


def worst_error(runs: list[dict[str, Any]]) -> tuple[float | None, str | None]:
    """The largest |error| over every scored plan of ``runs`` (analysed runs with
    ``plan_predictions``), and a line per seed saying how many plans were scored."""
    errors = [(run["seed"], p) for run in runs for p in run.get("plan_predictions") or []]
    if not errors:
        return None, None
    worst = max(abs(p["error"]) for _, p in errors)
    seeds = sorted({seed for seed, _ in errors})
    detail = "; ".join(
        f"seed {seed}: " + ", ".join(f"step {p['step']} {p['predicted_s'] * 1e3:.0f} ms predicted / "
                                     f"{p['measured_s'] * 1e3:.0f} measured ({p['error']:+.0%})"
                                     for s, p in errors if s == seed)
        for seed in seeds)
    return worst, detail
