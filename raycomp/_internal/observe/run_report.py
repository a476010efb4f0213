"""``raycomp inspect RUN`` and ``raycomp plot RUN``: what a run did, read from its files alone.

RUN is a run's output directory, the one :func:`raycomp.train.finish` and ``python -m
jobs.train`` write: ``summary.json`` (at the end), ``steps/rank<r>.jsonl`` (every step of
every rank), ``evals.jsonl`` and ``plans.jsonl`` (rank 0's plan timeline: each switch with
its step, the plan before and after, the rule that chose it and why,
:mod:`raycomp._internal.train.plan_log`). By default that directory is the Ray Train run's,
``<storage_path>/<name>``; RUN may also be the storage path itself when one run there has
raycomp's files. Nothing is asked of the controller or of Ray, so a finished run can be
read anywhere its directory is, and a running one shows what it has written so far.

``inspect`` prints the plan timeline with reasons, the bytes each plan sent (all ranks'
wire bytes against the dense all-reduce's, and the ratio), the guard's fallbacks and
recoveries, and local steps' syncs. ``plot`` draws the plan timeline, bytes per step and
the loss in one PNG (matplotlib, an optional dependency).

A run that stayed dense all run says why (:func:`dense_why`): one worker, or the adaptive
policy's last decision (communication against compute, lossy rungs off for an optimizer
not linear in the gradient). A run without ``summary.json`` is still running or ended
without :func:`raycomp.train.finish`; nothing in its files tells which, so ``inspect`` says
both and how long ago its last step was written.

Exit codes: 0; 2 when RUN is not a run directory (one line on stderr saying what was
expected there); 1 when ``plot`` lacks matplotlib (``pip install "raycomp[plot]"``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NotARun", "PLOT_INSTALL", "Run", "dense_why", "figure", "find_run", "inspect", "load", "main", "plot",
           "why_text"]

EXIT_NOT_A_RUN = 2
EXIT_MISSING_PACKAGE = 1
#: what installs ``raycomp plot``'s optional dependency (matplotlib)
PLOT_INSTALL = 'pip install "raycomp[plot]"'


class NotARun(ValueError):
    """RUN is not a run directory (nor a storage path holding exactly one)."""


@dataclass
class Run:
    """A run's files, read: ``summary`` (None while it runs), ``steps`` by rank (each rank's
    records in step order), ``evals`` and ``timeline`` (rank 0's ``plans.jsonl``; derived
    from rank 0's step log and the controller's events when the run did not write one)."""

    directory: Path
    summary: dict[str, Any] | None
    steps: dict[int, list[dict[str, Any]]]
    evals: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    derived_timeline: bool = False
    levels: list[dict[str, Any]] = field(default_factory=list)


def _is_run(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / "steps").is_dir()


def find_run(path: Path) -> Path:
    """The run directory RUN names: itself, or its one subdirectory holding a run (a Ray
    Train storage path). Raises :class:`NotARun` with what was expected."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise NotARun(f"{path}: no such directory (expected a run's output directory, with summary.json "
                      "and steps/rank<r>.jsonl, or a Ray Train storage path holding one)")
    if _is_run(path):
        return path
    runs = sorted(child for child in path.iterdir() if child.is_dir() and _is_run(child))
    if len(runs) == 1:
        return runs[0]
    if runs:
        names = ", ".join(run.name for run in runs)
        raise NotARun(f"{path} holds {len(runs)} runs ({names}): name one of them")
    raise NotARun(f"{path} is not a raycomp run directory: expected summary.json and steps/rank<r>.jsonl "
                  "there (a run's output directory) or in one of its subdirectories (a Ray Train storage "
                  "path, <storage_path>/<name>)")


def _lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines of ``path`` ([] if absent); a line cut short (a run still writing, or a
    crash) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def load(directory: Path) -> Run:
    """Read the run in ``directory`` (see :func:`find_run`)."""
    summary_path = directory / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    except json.JSONDecodeError as error:
        raise NotARun(f"{summary_path}: not JSON ({error})") from None
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((directory / "steps").glob("rank*.jsonl")):
        suffix = path.stem[len("rank"):]
        if suffix.isdigit():
            steps[int(suffix)] = _lines(path)
    timeline = _lines(directory / "plans.jsonl")
    run = Run(directory, summary, steps, _lines(directory / "evals.jsonl"), timeline)
    if not timeline:
        run.timeline, run.derived_timeline = _derived_timeline(run), True
    run.levels = _levels(run)
    return run


def _derived_timeline(run: Run) -> list[dict[str, Any]]:
    """A timeline from rank 0's step log (where its plan version or fallback changed) and
    the controller's plan events in ``summary.json`` (their reasons), for a run that wrote
    no ``plans.jsonl``."""
    events = ((run.summary or {}).get("policy") or {}).get("events") or []
    reasons = {}
    for event in events:
        if event.get("kind") == "plan" and str(event.get("detail", "")).startswith("version "):
            why = event.get("why") or {}
            reasons[int(str(event["detail"]).split()[1])] = (why.get("rule"), event.get("reason"))
    timeline: list[dict[str, Any]] = []
    previous: tuple[int, bool] | None = None
    for record in run.steps.get(0, []):
        key = (record["plan_version"], bool(record.get("fallback")))
        if key == previous:
            continue
        kind = "start" if previous is None else "fallback" if key[1] and not previous[1] else \
            "recovered" if previous[1] and not key[1] else "plan"
        rule, reason = reasons.get(key[0], (None, ""))
        to = "dense" if record.get("dense") else "compressed"
        timeline.append({"step": record["step"], "kind": kind, "version": key[0],
                         "from": timeline[-1]["to"] if timeline else None, "to": to,
                         "rule": None if key[1] else rule, "reason": "guard" if key[1] else reason})
        previous = key
    return timeline


def _levels(run: Run) -> list[dict[str, Any]]:
    """Bytes by the plan in force (version, and whether the guard held it dense), summed
    over the ranks, one row per stretch of steps under one plan: a plan left and taken
    again (the guard's fallback and recovery) has a row per stretch, so no two rows' step
    ranges overlap. Each step's bytes are the growth of its rank's running totals."""
    levels: dict[tuple[int, int, bool], dict[str, Any]] = {}
    for records in run.steps.values():
        wire_before = dense_before = 0.0
        stretch, previous = -1, None
        for record in records:
            plan = (record["plan_version"], bool(record.get("fallback")))
            if plan != previous:  # every rank installs the same plans at the same steps
                stretch, previous = stretch + 1, plan
            key = (stretch, *plan)
            level = levels.setdefault(key, {"version": plan[0], "fallback": plan[1], "dense": record.get("dense"),
                                            "first": record["step"], "last": record["step"], "steps": set(),
                                            "wire": 0.0, "dense_bytes": 0.0})
            level["first"], level["last"] = min(level["first"], record["step"]), max(level["last"], record["step"])
            level["steps"].add(record["step"])
            level["wire"] += record["wire_bytes"] - wire_before
            level["dense_bytes"] += record["dense_bytes"] - dense_before
            wire_before, dense_before = record["wire_bytes"], record["dense_bytes"]
    labels = {}
    for entry in run.timeline:  # the latest summary of each version (a fallback has its own key)
        labels[(entry["version"], entry.get("kind") == "fallback")] = entry.get("to")
    out = []
    for level in sorted(levels.values(), key=lambda level: level["first"]):
        plan = (level["version"], level["fallback"])
        level["steps"] = len(level["steps"])
        level["label"] = "dense (guard)" if plan[1] else labels.get(plan) or labels.get((plan[0], False)) or \
            ("dense" if level["dense"] else "compressed")
        out.append(level)
    return out


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
    for level in run.levels:
        span = f"{level['first']}-{level['last']}"
        name = f"v{level['version']}"
        lines.append(f"  {name:<6} {span:>11} {_bytes(level['wire']):>12} {_bytes(level['dense_bytes']):>12} "
                     f"{_ratio(level['wire'], level['dense_bytes']):>8}  {level['label']}")
        wire_total += level["wire"]
        dense_total += level["dense_bytes"]
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


def _plan_bands(run: Run, end: int) -> list[tuple[int, int, str, bool]]:
    """The plan timeline as bands: (first step, step after the last, what, guard fallback)."""
    bands = []
    for index, entry in enumerate(run.timeline):
        stop = run.timeline[index + 1]["step"] if index + 1 < len(run.timeline) else end
        guarded = entry.get("kind") == "fallback"
        bands.append((entry["step"], max(stop, entry["step"]), str(entry.get("to")), guarded))
    return bands


def plot(run: Run, out: Path) -> Path:
    """Draw the run (:func:`figure`) into a PNG at ``out``. Needs matplotlib (ImportError
    otherwise)."""
    import matplotlib.pyplot as plt

    fig = figure(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def figure(run: Run) -> Any:
    """The run as a matplotlib figure of three panels sharing the step axis: loss (rank
    0, and evaluations), wire and dense bytes per step (all ranks) on a linear axis from 0,
    so that their heights show their real ratio, and the plan timeline (a band per plan,
    colored by what the plan does, fallbacks in red; a legend below names each color, a
    band wide enough carries its version). Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rank0 = run.steps.get(0, [])
    per_step: dict[int, list[float]] = {}
    for records in run.steps.values():
        wire_before = dense_before = 0.0
        for record in records:
            totals = per_step.setdefault(record["step"], [0.0, 0.0])
            totals[0] += record["wire_bytes"] - wire_before
            totals[1] += record["dense_bytes"] - dense_before
            wire_before, dense_before = record["wire_bytes"], record["dense_bytes"]
    fig, (loss_ax, bytes_ax, plan_ax) = plt.subplots(3, 1, sharex=True, figsize=(9, 7),
                                                     gridspec_kw={"height_ratios": [3, 3, 1.4]})
    loss_ax.plot([r["step"] for r in rank0], [r["loss"] for r in rank0], lw=0.8, label="training loss (rank 0)")
    loss_ax.set_ylabel("loss")
    if run.evals:
        evals_ax = loss_ax.twinx()
        key = next((k for k in run.evals[-1] if k not in ("time", "epoch", "step")
                    and isinstance(run.evals[-1][k], int | float)), None)
        if key is not None:
            points = [(e["step"], e[key]) for e in run.evals if isinstance(e.get(key), int | float)]
            evals_ax.plot(*zip(*points, strict=True), "o-", color="tab:orange", ms=3, lw=0.8, label=key)
            evals_ax.set_ylabel(key)
    steps = sorted(per_step)
    wire = [per_step[s][0] for s in steps]
    dense = [per_step[s][1] for s in steps]
    bytes_ax.plot(steps, wire, lw=0.8, color="tab:green", label="wire")
    bytes_ax.plot(steps, dense, lw=0.8, ls="--", color="tab:gray", label="dense all-reduce")
    # linear from 0: a log axis over a narrow range (1.0937e6-1.0938e6) makes 80 bytes look
    # like the wire far above dense
    bytes_ax.set_ylim(0, max([*wire, *dense, 1.0]) * 1.4)  # room above the lines for the legend
    bytes_ax.yaxis.set_major_formatter(matplotlib.ticker.EngFormatter(unit="B"))
    total_wire, total_dense = sum(wire), sum(dense)
    ratio = f"dense / wire {total_dense / total_wire:.2f}x" if total_wire > 0 else "no bytes on the wire"
    bytes_ax.set_ylabel("bytes / step (all ranks)")
    bytes_ax.legend(loc="upper right", ncol=2, fontsize=8, title=ratio, title_fontsize=8)
    end = (max(steps) + 1) if steps else 1
    bands = _plan_bands(run, end)
    colors = plt.get_cmap("tab10")
    what = list(dict.fromkeys(to for _, _, to, guarded in bands if not guarded))  # each plan one color
    handles: dict[str, Any] = {}
    span = max(end - min((b[0] for b in bands), default=0), 1)
    for index, (start, stop, to, guarded) in enumerate(bands):
        color = "tab:red" if guarded else colors(what.index(to) % 10)
        label = f"{to} (guard fallback)" if guarded else to
        handles[label] = plan_ax.axvspan(start - 0.5, stop - 0.5, color=color, alpha=0.35, lw=0, label=label)
        if (stop - start) / span >= 0.04:  # a version on its band where it fits; the legend says what
            plan_ax.text(start, 0.3 + 0.4 * (index % 2), f" v{run.timeline[index].get('version')}", va="center",
                         fontsize=7, clip_on=True)
    if handles:
        plan_ax.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.55),
                       ncol=min(2, len(handles)), fontsize=7, frameon=False)
    plan_ax.set_ylim(0, 1)
    plan_ax.set_yticks([])
    plan_ax.set_ylabel("plan")
    plan_ax.set_xlabel("step")
    fig.suptitle(str((run.summary or {}).get("run_id", run.directory.name)))
    fig.tight_layout()
    return fig


def main(args: Any) -> int:
    """``raycomp inspect`` / ``raycomp plot`` (``args.command``, ``args.run``, ``args.out``)."""
    try:
        run = load(find_run(Path(args.run)))
    except NotARun as error:
        print(f"raycomp {args.command}: {error}", file=sys.stderr)
        return EXIT_NOT_A_RUN
    if args.command == "inspect":
        print(inspect(run))
        return 0
    out = Path(args.out) if getattr(args, "out", None) else run.directory / "raycomp.png"
    try:
        path = plot(run, out)
    except ImportError as error:
        missing = (getattr(error, "name", None) or "matplotlib").split(".")[0]
        print(f"raycomp plot: needs {missing}, not installed: {PLOT_INSTALL}", file=sys.stderr)
        return EXIT_MISSING_PACKAGE
    print(f"wrote {path}")
    return 0
