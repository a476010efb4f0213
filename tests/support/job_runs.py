"""Runs of ``python -m jobs.train`` (and of the fault drill) on the digits config, in this
process against the session's Ray, and where a run left its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from jobs.config import JobConfig
from jobs.faults import DrillConfig
from jobs.train import prepare, run
from tests.support.repo import REPO

__all__ = ["DIGITS", "last_checkpoint", "latest_checkpoint", "train"]

DIGITS = str(REPO / "jobs" / "configs" / "digits.yaml")


def train(tmp_path: Path, name: str, *overrides: str) -> dict:
    """One run of ``python -m jobs.train``; of ``python -m jobs.faults`` (the drill's config,
    :class:`jobs.faults.DrillConfig`) when an override sets ``faults.*``."""
    drill = any(o.startswith("faults.") for o in overrides)
    config, run_id, output = prepare(["--config", DIGITS, "--output", str(tmp_path / name),
                                      "--run-id", f"{name}-{tmp_path.name}", *overrides],
                                     DrillConfig if drill else JobConfig)
    summary = run(config, run_id, output)
    assert json.loads((output / "summary.json").read_text())["run_id"] == run_id
    return summary


def latest_checkpoint(output: Path) -> Path:
    """The newest ``checkpoint_*`` directory under ``output``."""
    return sorted(p for p in output.glob("checkpoint_*") if p.is_dir())[-1]


def last_checkpoint(summary: dict) -> Path:
    """A run's last checkpoint: in its output directory, or, for a run trained in the shared
    fit (tests/support/runs_in_turn.py), the one its summary names."""
    return Path(summary["checkpoint"]) if "checkpoint" in summary else latest_checkpoint(Path(summary["output_dir"]))
