"""One run's traces read as numbers: the evaluations that meet a target, the training clock
without evaluation pauses, the steady step time, where compression started, and the bytes
torch's hooks send (they keep no ledger, so the benchmark models them).

Pure functions of the step and evaluation records a run writes (``steps/rank0.jsonl``,
``evals.jsonl``) and of the NIC samples the driver takes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CONSECUTIVE", "eval_series", "first_compressed_step", "interpolate_counters", "meets", "steady_step_s",
    "target_index", "torch_hook_bytes", "training_clock",
]

CONSECUTIVE = 2  # the target must hold at this many consecutive evaluations


def meets(value: float | None, target: float, lower_is_better: bool) -> bool:
    """Whether an evaluation meets the target (equality counts)."""
    if value is None or not math.isfinite(value):
        return False
    return value <= target if lower_is_better else value >= target


def target_index(values: Sequence[float | None], target: float, lower_is_better: bool,
                 consecutive: int = CONSECUTIVE) -> int | None:
    """Index of the first evaluation from which the target holds at ``consecutive``
    consecutive evaluations (that one included); None if it never does. A hit at the last
    evaluation(s) without enough evaluations after it is not confirmed: None."""
    run = 0
    for i, value in enumerate(values):
        run = run + 1 if meets(value, target, lower_is_better) else 0
        if run == consecutive:
            return i - consecutive + 1
    return None


def eval_series(evals: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Evaluations sorted by step, one per step (the first), steps > 0, with the metric."""
    key, seen, out = f"eval_{metric}", set(), []
    for ev in sorted(evals, key=lambda e: (int(e.get("step", 0)), e.get("time", 0))):
        step = int(ev.get("step", 0))
        if step <= 0 or step in seen or ev.get(key) is None:
            continue
        seen.add(step)
        out.append({"step": step, "value": float(ev[key]), "time": ev.get("time")})
    return out


def training_clock(steps: list[dict[str, Any]], eval_steps: Sequence[int],
                   window: int = 5) -> dict[int, float]:
    """Step count -> training seconds, evaluation pauses taken out.

    ``steps`` are step records (``step``, ``time`` = when the step ended). A run that has done
    ``s`` steps did so at record ``s - 1``'s time; the clock starts at the end of step 0. An
    evaluation after ``s`` steps (and the report that goes with it) sits in the gap between
    records ``s - 1`` and ``s``: its pause is that gap minus the median of the ``window``
    gaps before it. Returns ``{s: seconds}`` for every ``s`` with a record ``s - 1``.
    """
    times = {int(r["step"]): float(r["time"]) for r in steps if r.get("time") is not None}
    if 0 not in times:
        return {}
    ordered = sorted(times)
    gaps = {s: times[s] - times[s - 1] for s in ordered if s - 1 in times}
    evals = set(eval_steps)
    paused, clock = 0.0, {}
    for s in ordered:
        if s in evals and s in gaps:
            before = [gaps[j] for j in range(s - window, s) if j in gaps and j not in evals]
            paused += max(0.0, gaps[s] - statistics.median(before)) if before else 0.0
        clock[s + 1] = times[s] - times[0] - paused
    return clock


def steady_step_s(steps: list[dict[str, Any]], eval_steps: Sequence[int], start: int,
                  end: int | None = None) -> tuple[float | None, int]:
    """Mean seconds per step over the gaps from step ``start`` on (to step ``end``, included,
    when given), evaluation gaps excluded (control boundaries included: they are part of the
    cost of a step); and how many gaps."""
    times = {int(r["step"]): float(r["time"]) for r in steps if r.get("time") is not None}
    evals = set(eval_steps)
    gaps = [times[s] - times[s - 1] for s in sorted(times) if s >= max(start, 1) and s - 1 in times
            and s not in evals and (end is None or s <= end)]
    return (sum(gaps) / len(gaps) if gaps else None), len(gaps)


def first_compressed_step(steps: list[dict[str, Any]]) -> int | None:
    """The first step whose wire bytes grew less than its dense bytes (from the ledger)."""
    prev_w, prev_d = 0.0, 0.0
    for r in sorted(steps, key=lambda r: r["step"]):
        w, d = float(r.get("wire_bytes") or 0), float(r.get("dense_bytes") or 0)
        if d - prev_d > 0 and (w - prev_w) < 0.99 * (d - prev_d):
            return int(r["step"])
        prev_w, prev_d = w, d
    return None


def torch_hook_bytes(hook: str, layers: dict[str, list[int]], world: int, steps: int,
                     rank: int = 2, start_iter: int = 0, min_compression_rate: float = 2.0,
                     period: int = 1) -> list[float]:
    """Bytes one rank transmits per step under torch's communication ``hook`` (ring
    all-reduce model); dense fp32 before ``start_iter`` (PowerSGD's start, the casts' and
    post-local SGD's warm-up).

    ``localsgd``: post-local SGD, the fp32 parameters all-reduced after the optimizer steps
    ``start_iter``, ``start_iter + period``, ... (``PeriodicModelAverager``), nothing in
    between; ``diloco``: torchft's DiLoCo, the fp32 pseudo-gradient all-reduced after every
    ``period``-th step (steps ``period - 1``, ``2 period - 1``, ...).
    """
    factor = 2 * (world - 1) / world
    numel = sum(math.prod(s) for s in layers.values())
    dense = factor * 4 * numel
    if hook == "allreduce":
        return [dense] * steps
    if hook in ("fp16", "bf16"):
        return [dense if step < start_iter else factor * 2 * numel for step in range(steps)]
    if hook == "localsgd":
        return [dense if step < start_iter or (step - start_iter) % period == 0 else 0.0 for step in range(steps)]
    if hook == "diloco":
        return [dense if (step + 1) % period == 0 else 0.0 for step in range(steps)]
    compressed = 0
    for shape in layers.values():  # powerSGD_hook: tensor.view(shape[0], -1); 1-D go dense
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, rank)
        if len(shape) > 1 and (n + m) * r * min_compression_rate < n * m:
            compressed += (n + m) * r
        else:
            compressed += n * m
    return [dense if step < start_iter else factor * 4 * compressed for step in range(steps)]


def interpolate_counters(samples: list[list[float]], t: float) -> tuple[float, float]:
    """Counters (tx, rx) at time ``t`` by linear interpolation of the samples."""
    if not samples:
        return (0.0, 0.0)
    if t <= samples[0][0]:
        return (samples[0][1], samples[0][2])
    for (t1, tx1, rx1), (t2, tx2, rx2) in zip(samples, samples[1:], strict=False):
        if t1 <= t <= t2:
            w = (t - t1) / (t2 - t1) if t2 > t1 else 1.0
            return (tx1 + w * (tx2 - tx1), rx1 + w * (rx2 - rx1))
    return (samples[-1][1], samples[-1][2])
