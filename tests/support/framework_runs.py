"""What the framework integrations' tests share: one Ray Train fit whose workers write their
findings per rank (the several framework runs, then the killed-and-resumed one), and the
checks of the guard's run (NaN on one rank, fallback, recovery, same plan)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.controller_fit import fit_with_controller
from tests.support.step_logs import step_logs
from tests.support.wire import FLIGHT_RECORDER_ENV


def fit_and_read(train_func: Callable[[dict], None], tmp: Path, prefix: str) -> list[dict[str, Any]]:
    """Run ``train_func`` (one worker restart allowed); per rank, its ``rank<r>.json`` with its
    ``killed<r>.json`` under ``"killed"`` (and whether rank 1 was killed, ``"marker"``)."""
    fit_with_controller(train_func, tmp, prefix, max_failures=1, worker_env=FLIGHT_RECORDER_ENV)
    out = tmp / "out"
    return [{**json.loads((out / f"rank{r}.json").read_text()),
             "killed": {**json.loads((out / f"killed{r}.json").read_text()),
                        "marker": (out / "rank1-was-killed").exists()}} for r in (0, 1)]


def assert_guard_run(guard: dict[str, Any], nan_step: int, stable: int, min_switches: int) -> list[list[dict]]:
    """The guard's 32-step run: NaN on one rank at ``nan_step`` falls back to dense on every
    rank and recovers ``stable`` steps later, the same plan everywhere; returns the step logs."""
    assert guard["global_step"] == guard["steps"] == 32
    events = guard["fallback_events"]
    assert events[0] == {"step": nan_step, "kind": "fallback", "reason": "nonfinite_gradient",
                         "detail": "NaN/Inf in gradients or loss"}
    assert events[1]["kind"] == "recovered" and events[1]["step"] == nan_step + stable
    assert guard["ddp_bucket_cap_mb"] == 1.0  # raycomp's bucket cap for a small model, not DDP's 25 MB
    assert guard["skipped_steps"] == 1 and guard["plan_switches"] >= min_switches
    assert guard["final_plan"]["default"] == {"name": "int8"}
    logs = step_logs(guard["output_dir"], ranks=2)
    for records in logs:
        assert [r["step"] for r in records] == list(range(32))
        by_step = {r["step"]: r for r in records}
        assert not by_step[nan_step]["applied"] and not by_step[nan_step - 1]["dense"]
        assert all(by_step[s]["dense"] for s in range(nan_step + 1, nan_step + stable + 1))
        assert not by_step[31]["dense"]
    for mine, theirs in zip(*logs, strict=True):
        assert (mine["plan_version"], mine["plan_digest"]) == (theirs["plan_version"], theirs["plan_digest"])
    assert all(math.isfinite(r["loss"]) for r in logs[0] if r["step"] > nan_step)  # the NaN never applied
    return logs
