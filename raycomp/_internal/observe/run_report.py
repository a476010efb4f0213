"""``raycomp inspect RUN``: what a run did, in words, read from its files alone
(:mod:`raycomp._internal.observe.run_files`).

It prints the plan timeline with reasons, the bytes each plan sent (all ranks' wire bytes
against the dense all-reduce's, and the ratio), the guard's fallbacks and recoveries, and
local steps' syncs.

A run that stayed dense all run says why (:func:`dense_why`): one worker, or the adaptive
policy's last decision (communication against compute, lossy rungs off for an optimizer
not linear in the gradient). A run without ``summary.json`` is still running or ended
without :func:`raycomp.train.finish`; nothing in its files tells which, so ``inspect`` says
both and how long ago its last step was written.

Exit codes: 0; 2 when RUN is not a run directory
(:data:`~raycomp._internal.observe.run_files.EXIT_NOT_A_RUN`).
"""

from __future__ import annotations

import time
from typing import Any

from raycomp._internal.observe.run_files import EXIT_NOT_A_RUN, Run, open_run

__all__ = ["dense_why", "inspect", "main", "why_text"]


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def _ratio(wire: float, dense: float) -> str:
    return f"{dense / wire:.2f}x" if wire > 0 else "-"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{max(seconds, 0):.0f} s"


def _status(run: Run, now: float | None = None) -> str:
    """The run's status: summary.json's, or, without one, what its files can tell: a run
    still running and one that ended without :func:`raycomp.train.finish` look the same
    (no file records the end), so both are named, with the age of the last step written."""
    if run.summary is not None:
        return str(run.summary.get("status", "no status in summary.json"))
    logs = [p for p in (run.directory / "steps").glob("rank*.jsonl")]
    last = max((p.stat().st_mtime for p in logs), default=None)
    ago = "" if last is None else f"; last step written {_age((now or time.time()) - last)} ago"
    return f"no summary.json: still running, or ended without raycomp.train.finish(){ago}"


def _timeline_counts(timeline: list[dict[str, Any]]) -> str:
    """What the timeline's rows are, counted so that the counts add up to the rows."""
    kinds = [entry.get("kind", "plan") for entry in timeline]
    counts = [(sum(k in ("start", "resume") for k in kinds), "start", "starts"),
              (kinds.count("plan"), "controller switch", "controller switches"),
              (kinds.count("fallback"), "guard fallback", "guard fallbacks"),
              (kinds.count("recovered"), "recovery", "recoveries")]
    named = sum(count for count, _, _ in counts)
    counts.append((len(kinds) - named, "other", "other"))
    parts = [f"{count} {one if count == 1 else many}" for count, one, many in counts if count]
    rows = f"{len(kinds)} row{'' if len(kinds) == 1 else 's'}"
    return f"{rows}: {', '.join(parts)}" if parts else rows


def dense_why(summary: dict[str, Any]) -> str | None:
    """Why a run stayed dense all run, in words that agree with its figures; None when it
    sent fewer bytes than dense (a plan compressed) or its summary cannot tell.

    One worker has no all-reduce to shrink. Otherwise the policy's own last word: the
    adaptive policy's last decision (communication against compute, and what it weighed),
    with its lossy rungs named off when they were (``adaptive.lossy`` resolved to never:
    Adam and other optimizers whose update is not linear in the gradient,
    :mod:`raycomp._internal.train.lossy`)."""
    world = summary.get("world_size")
    if world == 1:
        return "one worker: there is no all-reduce to shrink, so compression has nothing to save"
    wire, dense = summary.get("wire_bytes_total"), summary.get("dense_bytes_total")
    if not isinstance(wire, int | float) or not isinstance(dense, int | float) or not dense or wire < dense:
        return None
    policy = summary.get("policy") or {}
    details = policy.get("policy_details") or {}
    history = details.get("history") or []
    warm = details.get("warmup_history") or []
    if history:
        why = f"{policy.get('name', 'the policy')}: {history[-1][2]}"
    elif warm:
        why = f"{policy.get('name', 'the policy')}: warm-up: {warm[-1][2]}"
    elif "bandwidth_bytes_per_s" in details and details["bandwidth_bytes_per_s"] is None:
        why = f"{policy.get('name', 'the policy')}: the link was never timed (no dense interval measured)"
    else:
        plans = [e for e in policy.get("events") or [] if e.get("kind") == "plan" and e.get("reason")]
        reason = plans[-1]["reason"] if plans else (summary.get("final_plan") or {}).get("reason")
        why = f"policy {policy.get('name', '?')}: {reason or 'its plan is dense'}"
    if details.get("lossy") is False:
        why += ("; lossy rungs off (adaptive.lossy: never, as for Adam and other optimizers whose update is "
                "not linear in the gradient)")
    return why


def inspect(run: Run, now: float | None = None) -> str:
    """The text ``raycomp inspect`` prints (``now``: the time the age of a run without a
    summary is told from; default the clock's)."""
    summary = run.summary or {}
    lines = []
    steps = summary.get("steps", max((r[-1]["step"] + 1 for r in run.steps.values() if r), default=0))
    policy = (summary.get("policy") or {}).get("name", "?")
    lines.append(f"run {summary.get('run_id', run.directory.name)}: {_status(run, now)}, {steps} steps, "
                 f"{summary.get('world_size', len(run.steps))} ranks, policy {policy}")
    lines.append(f"directory: {run.directory}")
    held = dense_why(summary if run.summary is not None else {"world_size": len(run.steps)})
    if held:
        lines.append(f"dense all run: {held}")

    source = "rank 0's step log and the controller's events" if run.derived_timeline else "plans.jsonl"
    lines += ["", f"plan timeline ({_timeline_counts(run.timeline)}; from {source}):"]
    lines += [_timeline_line(entry) for entry in run.timeline] or ["  (no plan recorded)"]
    by_rule = (summary.get("policy") or {}).get("plan_switches_by_rule")
    if by_rule:
        lines.append("  switches by rule (controller): "
                     + ", ".join(f"{rule} {count}" for rule, count in sorted(by_rule.items())))

    lines += ["", f"bytes by plan (all {len(run.steps)} ranks; wire: what they sent, dense: an all-reduce of "
              "the same gradients):"]
    lines.append(f"  {'plan':<6} {'steps':>11} {'wire':>12} {'dense':>12} {'ratio':>8}  what")
    wire_total = dense_total = 0.0
    for row in run.stretches:
        span = f"{row['first']}-{row['last']}"
        name = f"v{row['version']}"
        lines.append(f"  {name:<6} {span:>11} {_bytes(row['wire']):>12} {_bytes(row['dense_bytes']):>12} "
                     f"{_ratio(row['wire'], row['dense_bytes']):>8}  {row['label']}")
        wire_total += row["wire"]
        dense_total += row["dense_bytes"]
    lines.append(f"  total: wire {wire_total:,.0f} B ({_bytes(wire_total)}), dense {dense_total:,.0f} B "
                 f"({_bytes(dense_total)}), ratio {_ratio(wire_total, dense_total)}")
    if "wire_bytes_total" in summary:
        wire, dense = float(summary["wire_bytes_total"]), float(summary.get("dense_bytes_total", 0.0))
        if abs(wire - wire_total) > 0.5 or abs(dense - dense_total) > 0.5:
            lines.append(f"  summary.json: wire {wire:,.0f} B, dense {dense:,.0f} B, ratio {_ratio(wire, dense)} "
                         "(the rest after the last logged step: a final merge of local steps, or steps "
                         "no log holds)")
        else:
            lines.append("  (equal to summary.json's totals)")

    fallbacks = [entry for entry in run.timeline if entry.get("kind") in ("fallback", "recovered")]
    if not fallbacks:  # a run without plans.jsonl: rank 0's guard events, from the summary
        fallbacks = [{"step": e.get("step"), "kind": e.get("kind"), "reason": e.get("reason"),
                      "detail": e.get("detail")} for e in summary.get("fallback_events") or []]
    lines += ["", f"fallbacks to dense: {sum(1 for e in fallbacks if e.get('kind') == 'fallback')}"]
    for entry in fallbacks:
        lines.append(f"  step {entry['step']:>6}  {entry['kind']:<9}  {entry.get('reason') or ''}")
    skipped = summary.get("skipped_steps")
    if skipped:
        lines.append(f"  steps the guard skipped: {skipped}")

    local = [entry for entry in run.timeline if str(entry.get("to", "")).startswith("local steps")]
    syncs = summary.get("outer_steps")
    if not local and not syncs:
        lines += ["", "local-step syncs: none (no plan in local steps)"]
    else:
        lines += ["", f"local-step syncs: {syncs if syncs is not None else 'not in summary.json'} applied"]
    for entry in local:
        lines.append(f"  step {entry['step']:>6}  v{entry['version']}  {entry['to']}")
    if run.evals:
        last = run.evals[-1]
        shown = {k: v for k, v in last.items() if k not in ("time", "epoch", "step")}
        lines += ["", f"last evaluation (step {last.get('step')}): "
                  + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())]
    return "\n".join(lines)


def why_text(record: dict[str, Any]) -> str:
    """The why of a timeline line in one phrase: its rule, then the reason's prose (which
    renders the decision's facts), e.g. ``adaptive.band: link 1.2 MB/s, communication 20x compute ...``."""
    rule, reason = record.get("rule"), record.get("reason") or ""
    if rule and reason:
        return f"{rule}: {reason}"
    return rule or reason or "no reason given"


def _timeline_line(entry: dict[str, Any]) -> str:
    change = entry.get("to") if entry.get("from") is None else f"{entry['from']} -> {entry.get('to')}"
    return f"  step {entry['step']:>6}  {entry.get('kind', 'plan'):<9}  v{entry.get('version', '?'):<3} " \
           f"{change}  [{why_text(entry)}]"


def main(args: Any) -> int:
    """``raycomp inspect`` (``args.run``)."""
    run = open_run("inspect", args.run)
    if run is None:
        return EXIT_NOT_A_RUN
    print(inspect(run))
    return 0
