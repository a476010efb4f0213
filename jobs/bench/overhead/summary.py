"""What the overhead benchmark's block pairs come to: the median of raycomp's block time over
the reference side's, its quartiles, a 95% bootstrap interval of the median, the verdict
against :data:`GOAL`; and raycomp's steps by their place among the control boundaries."""

from __future__ import annotations

import random
import statistics
from typing import Any

__all__ = ["GOAL", "PLANS", "median_interval", "step_places", "summarize"]

GOAL = 1.03
#: --plan: the compressor every side's plan holds, and the reference side it is measured against
PLANS = {"dense": ("none", "plain DDP"), "bf16": ("bf16", "torch's bf16 hook")}


def summarize(rows: list[dict[str, Any]], block: int, plan: str = "dense") -> dict[str, Any]:
    """The counted pairs' ratios (raycomp over the reference side: plain DDP, or torch's
    bf16 hook under ``--plan bf16``): median and quartiles; the median step of each side in
    ms; PASS when the median ratio is at most :data:`GOAL`."""
    counted = [r for r in rows if r["counted"]]
    if not counted:
        raise ValueError("overhead: no counted block pair (every pair was a warm-up pair)")
    ratios = sorted(r["raycomp_s"] / r["plain_s"] for r in counted)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    median = statistics.median(ratios)
    low, high = median_interval(ratios)
    out = {
        "pairs": len(counted), "block_steps": block,
        "ratio_median": median, "ratio_q1": quartiles[0], "ratio_q3": quartiles[2],
        "ratio_median_low": low, "ratio_median_high": high,
        "resolved": high <= GOAL or low > GOAL,
        "plain_step_ms": 1e3 * statistics.median(r["plain_s"] for r in counted) / block,
        "raycomp_step_ms": 1e3 * statistics.median(r["raycomp_s"] for r in counted) / block,
        "goal": f"raycomp.train step with a {plan} plan <= {GOAL:g}x {PLANS[plan][1]}'s (median over block pairs)",
        "ok": median <= GOAL,
    }
    if all("hook_s" in r for r in counted):  # the reference side (reports before it have none)
        out["hook_ratio_median"] = statistics.median(r["hook_s"] / r["plain_s"] for r in counted)
        out["hook_step_ms"] = 1e3 * statistics.median(r["hook_s"] for r in counted) / block
    return out


def step_places(records: list[dict[str, Any]], interval: int, first: int | None, agree_after: int,
                skip: int) -> dict[str, float]:
    """The median ms of raycomp's steps (rank 0's step log, from step ``skip`` on) by their
    place among the control boundaries: the step that reports the statistics, the one after
    it, the one whose end the ranks agree at (``agree_after`` steps after the report; the
    report's own with 0), and every other step."""
    def boundary(done: int) -> bool:
        return done > 0 and (done % interval == 0 or done == first)

    seconds: dict[str, list[float]] = {"boundary": [], "after it": [], "agreement": [], "others": []}
    for record in records:
        step = record["step"]
        if step < skip:
            continue
        done = step + 1  # steps done at this one's end, as the loop counts them
        place = "boundary" if boundary(done) else "agreement" if agree_after and boundary(done - agree_after) \
            else "after it" if boundary(step) else "others"
        seconds[place].append(record["seconds"])
    return {place: 1e3 * statistics.median(values) for place, values in seconds.items() if values}


def median_interval(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of the median of ``ratios``: the 2.5th and 97.5th percentiles of the
    medians of ``draws`` resamples of the pairs (a seeded bootstrap, the same every time).
    The quartiles say how the pairs spread; this says how well their median is known, so a
    reader can see whether the goal is resolved."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[min(draws - 1, int(0.975 * draws))]
