"""A run's files, read: what ``raycomp inspect`` and ``raycomp plot`` show, from nothing else.

RUN is a run's output directory, the one :func:`raycomp.train.finish` and ``python -m
jobs.train`` write: ``summary.json`` (at the end), ``steps/rank<r>.jsonl`` (every step of
every rank), ``evals.jsonl`` and ``plans.jsonl`` (rank 0's plan timeline: each switch with
its step, the plan before and after, the rule that chose it and why,
:mod:`raycomp._internal.train.plan_log`). By default that directory is the Ray Train run's,
``<storage_path>/<name>``; RUN may also be the storage path itself when one run there has
raycomp's files. Nothing is asked of the controller or of Ray, so a finished run can be
read anywhere its directory is, and a running one shows what it has written so far.

A RUN that is not a run directory ends the command with exit code 2 and one line on stderr
saying what was expected there (:func:`open_run`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EXIT_NOT_A_RUN", "NotARun", "Run", "find_run", "load", "open_run"]

EXIT_NOT_A_RUN = 2


class NotARun(ValueError):
    """RUN is not a run directory (nor a storage path holding exactly one)."""


@dataclass
class Run:
    """A run's files, read: ``summary`` (None while it runs), ``steps`` by rank (each rank's
    records in step order), ``evals`` and ``timeline`` (rank 0's ``plans.jsonl``; derived
    from rank 0's step log and the controller's events when the run did not write one), and
    ``stretches``: the bytes of each stretch of steps under one plan (:func:`_stretches`)."""

    directory: Path
    summary: dict[str, Any] | None
    steps: dict[int, list[dict[str, Any]]]
    evals: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    derived_timeline: bool = False
    stretches: list[dict[str, Any]] = field(default_factory=list)


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


def open_run(command: str, path: str | Path) -> Run | None:
    """The run RUN names, read; None after one line on stderr saying why it is not a run
    (the command then exits with :data:`EXIT_NOT_A_RUN`)."""
    try:
        return load(find_run(Path(path)))
    except NotARun as error:
        print(f"raycomp {command}: {error}", file=sys.stderr)
        return None


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
    run.stretches = _stretches(run)
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


def _stretches(run: Run) -> list[dict[str, Any]]:
    """Bytes by the plan in force (version, and whether the guard held it dense), summed
    over the ranks, one row per stretch of steps under one plan: a plan left and taken
    again (the guard's fallback and recovery) has a row per stretch, so no two rows' step
    ranges overlap. Each step's bytes are the growth of its rank's running totals."""
    rows: dict[tuple[int, int, bool], dict[str, Any]] = {}
    for records in run.steps.values():
        wire_before = dense_before = 0.0
        stretch, previous = -1, None
        for record in records:
            plan = (record["plan_version"], bool(record.get("fallback")))
            if plan != previous:  # every rank installs the same plans at the same steps
                stretch, previous = stretch + 1, plan
            key = (stretch, *plan)
            row = rows.setdefault(key, {"version": plan[0], "fallback": plan[1], "dense": record.get("dense"),
                                        "first": record["step"], "last": record["step"], "steps": set(),
                                        "wire": 0.0, "dense_bytes": 0.0})
            row["first"], row["last"] = min(row["first"], record["step"]), max(row["last"], record["step"])
            row["steps"].add(record["step"])
            row["wire"] += record["wire_bytes"] - wire_before
            row["dense_bytes"] += record["dense_bytes"] - dense_before
            wire_before, dense_before = record["wire_bytes"], record["dense_bytes"]
    labels = {}
    for entry in run.timeline:  # the latest summary of each version (a fallback has its own key)
        labels[(entry["version"], entry.get("kind") == "fallback")] = entry.get("to")
    out = []
    for row in sorted(rows.values(), key=lambda row: row["first"]):
        plan = (row["version"], row["fallback"])
        row["steps"] = len(row["steps"])
        row["label"] = "dense (guard)" if plan[1] else labels.get(plan) or labels.get((plan[0], False)) or \
            ("dense" if row["dense"] else "compressed")
        out.append(row)
    return out
