"""``raycomp inspect RUN`` and ``raycomp plot RUN``: what a run did, read from its files alone.

RUN is a run's output directory, the one :func:`raycomp.train.finish` and ``python -m
jobs.train`` write: ``summary.json`` (at the end), ``steps/rank<r>.jsonl`` (every step of
every rank), ``evals.jsonl`` and ``plans.jsonl`` (rank 0's plan timeline: each switch with
its step, the plan before and after, the rule that chose it and why,
:mod:`raycomp.train.plan_log`). By default that directory is the Ray Train run's,
``<storage_path>/<name>``; RUN may also be the storage path itself when one run there has
raycomp's files. Nothing is asked of the controller or of Ray, so a finished run can be
read anywhere its directory is, and a running one shows what it has written so far.

``inspect`` prints the plan timeline with reasons, the bytes each plan sent (all ranks'
wire bytes against the dense all-reduce's, and the ratio), the guard's fallbacks and
recoveries, and local steps' syncs. ``plot`` draws the plan timeline, bytes per step and
the loss in one PNG (matplotlib, an optional dependency).

Exit codes: 0; 2 when RUN is not a run directory (one line on stderr saying what was
expected there); 1 when ``plot`` lacks matplotlib.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NotARun", "Run", "find_run", "inspect", "load", "main", "plot", "why_text"]

EXIT_NOT_A_RUN = 2
EXIT_MISSING_PACKAGE = 1


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
    over the ranks: each step's bytes are the growth of its rank's running totals."""
    levels: dict[tuple[int, bool], dict[str, Any]] = {}
    for records in run.steps.values():
        wire_before = dense_before = 0.0
        for record in records:
            key = (record["plan_version"], bool(record.get("fallback")))
            level = levels.setdefault(key, {"version": key[0], "fallback": key[1], "dense": record.get("dense"),
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
    for key, level in sorted(levels.items(), key=lambda item: item[1]["first"]):
        level["steps"] = len(level["steps"])
        level["label"] = "dense (guard)" if key[1] else labels.get(key) or labels.get((key[0], False)) or \
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


def inspect(run: Run) -> str:
    """The text ``raycomp inspect`` prints."""
    summary = run.summary or {}
    lines = []
    status = summary.get("status", "running (no summary.json yet)")
    steps = summary.get("steps", max((r[-1]["step"] + 1 for r in run.steps.values() if r), default=0))
    policy = (summary.get("policy") or {}).get("name", "?")
    lines.append(f"run {summary.get('run_id', run.directory.name)}: {status}, {steps} steps, "
                 f"{summary.get('world_size', len(run.steps))} ranks, policy {policy}")
    lines.append(f"directory: {run.directory}")

    source = "rank 0's step log and the controller's events" if run.derived_timeline else "plans.jsonl"
    switches = sum(1 for entry in run.timeline if entry.get("kind") == "plan")
    lines += ["", f"plan timeline ({switches} switches; from {source}):"]
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
    renders the decision's facts), e.g. ``adaptive.band: slow link 1.2 MB/s, ...``."""
    rule, reason = record.get("rule"), record.get("reason") or ""
    if rule and reason:
        return f"{rule}: {reason}"
    return rule or reason or "no reason given"


def _timeline_line(entry: dict[str, Any]) -> str:
    change = entry.get("to") if entry.get("from") is None else f"{entry['from']} -> {entry.get('to')}"
    return f"  step {entry['step']:>6}  {entry.get('kind', 'plan'):<9}  v{entry.get('version', '?'):<3} " \
           f"{change}  [{why_text(entry)}]"


def plot(run: Run, out: Path) -> Path:
    """Draw the run: loss (rank 0, and evaluations), wire and dense bytes per step (all
    ranks), and the plan timeline (a band per plan, fallbacks in red); write a PNG to
    ``out``. Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    bytes_ax.plot(steps, [max(per_step[s][0], 1.0) for s in steps], lw=0.8, color="tab:green", label="wire")
    bytes_ax.plot(steps, [max(per_step[s][1], 1.0) for s in steps], lw=0.8, ls="--", color="tab:gray",
                  label="dense all-reduce")
    bytes_ax.set_yscale("log")
    bytes_ax.set_ylabel("bytes / step (all ranks)")
    bytes_ax.legend(loc="upper right", fontsize=8)
    end = (max(steps) + 1) if steps else 1
    colors = plt.get_cmap("tab10")
    for index, entry in enumerate(run.timeline):
        start = entry["step"]
        stop = run.timeline[index + 1]["step"] if index + 1 < len(run.timeline) else end
        guarded = entry.get("kind") == "fallback"
        plan_ax.axvspan(start - 0.5, stop - 0.5, color="tab:red" if guarded else colors(index % 10),
                        alpha=0.35, lw=0)
        plan_ax.text(start, 0.5, f" v{entry.get('version')} {entry.get('to')}", va="center", fontsize=7,
                     clip_on=True)
    plan_ax.set_yticks([])
    plan_ax.set_ylabel("plan")
    plan_ax.set_xlabel("step")
    fig.suptitle(str((run.summary or {}).get("run_id", run.directory.name)))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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
        missing = getattr(error, "name", None) or "matplotlib"
        print(f"raycomp plot: needs {missing.split('.')[0]}, not installed: pip install matplotlib",
              file=sys.stderr)
        return EXIT_MISSING_PACKAGE
    print(f"wrote {path}")
    return 0
