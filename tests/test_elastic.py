"""An elastic run end to end (long check): ``raycomp.train`` under Ray Train's
``ScalingConfig(num_workers=(2, 3))`` on a cluster of three nodes on this machine
(tests/support/elastic_run.py). One node is killed mid-run (its raylet SIGKILLed, then its
worker), the run goes on from the latest checkpoint on two workers, the node comes back and
the run grows back to three, and it finishes. Against the same run unbroken:

* the group went 3 -> 2 -> 3 workers, each restart from the latest step checkpoint;
* after each resize every new rank holds the same merged residual, and the error feedback
  the checkpoint's old ranks owed is what the new ranks owe (nothing a checkpoint held lost);
* it ends at the step budget, with test accuracy within 1% of the unbroken run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY, KILL_AFTER, GROW_AFTER = 140, 5, 42, 84
BASE = {"nodes": 3, "cpus": 1, "min_workers": 2, "max_workers": 3, "max_failures": 3, "steps": STEPS,
        "every_steps": EVERY, "batch": 96, "compressor": ["topk", {"ratio": 0.1}], "monitor_s": 5,
        "gate_timeout_s": 240}


def _run(work: Path, name: str, drill: dict | None) -> Path:
    output = work / name
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({**BASE, "output": str(output), "name": f"{name}-{work.name}"[:60], "drill": drill}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    env.pop("RAY_ADDRESS", None)
    with open(work / f"{name}.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "tests.support.elastic_run", str(spec)], env=env, cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, timeout=1200, check=False)
    driver = json.loads((output / "driver.json").read_text())
    assert done.returncode == 0 and driver["status"] == "succeeded", (driver, (work / f"{name}.log").read_text()[-3000:])
    return output


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _checkpoint_ranks(output: Path, step: int) -> list[dict]:
    """Every rank's own state in the checkpoint of ``step`` the run wrote."""
    for meta in sorted(output.glob("ray-train/*/checkpoint_*/meta.json")):
        found = json.loads(meta.read_text())
        if found["global_step"] == step:
            return [torch.load(meta.parent / f"rank{r}.pt", weights_only=False) for r in range(found["world_size"])]
    raise AssertionError(f"no checkpoint of step {step} under {output}")


def _residual_sum(own: dict) -> float:
    return float(sum(t.double().sum() for t in own["compression"]["memory"]["residuals"].values()))


def test_a_node_lost_and_regained_mid_run_finishes_within_one_percent_of_the_unbroken_run(tmp_path):
    started = time.monotonic()
    reference = _run(tmp_path, "unbroken", None)
    unbroken_s = time.monotonic() - started
    elastic = _run(tmp_path, "elastic", {"kill_after_step": KILL_AFTER, "grow_after_step": GROW_AFTER})
    events = json.loads((elastic / "driver.json").read_text())["events"]
    assert [e["event"] for e in events] == ["kill", "grow"], events

    starts = _lines(elastic / "starts.jsonl")
    groups: list[list[dict]] = []
    for start in sorted(starts, key=lambda s: s["time"]):
        if not groups or len(groups[-1]) == groups[-1][0]["world"]:
            groups.append([])
        groups[-1].append(start)
    sizes = [g[0]["world"] for g in groups]
    assert sizes == [3, 2, 3], sizes
    killed = events[0]
    assert not {s["pid"] for s in groups[1] + groups[2]} & set(killed["worker_pids"])
    for before, after in zip(groups, groups[1:], strict=False):
        restored = {s["restored_from"] for s in after}
        assert len(restored) == 1 and None not in restored
        step = restored.pop()
        gate = KILL_AFTER if before is groups[0] else GROW_AFTER
        assert step % EVERY == 0 and gate - EVERY < step <= gate  # the latest checkpoint before the gate
        olds = _checkpoint_ranks(elastic, step)
        assert len(olds) == before[0]["world"]
        owed = sum(_residual_sum(o) for o in olds) / len(olds)
        assert owed != 0.0  # Top-K's error feedback held something
        for s in after:  # every new rank holds the old ranks' mean: nothing the checkpoint held lost
            assert s["residual_sum"] == pytest.approx(owed, rel=1e-5, abs=1e-6)

    ran = _lines(elastic / "progress.jsonl")
    assert {r["step"] for r in ran if r["rank"] == 0} == set(range(1, STEPS + 1))
    got, want = json.loads((elastic / "result.json").read_text()), json.loads((reference / "result.json").read_text())
    assert got["steps"] == want["steps"] == STEPS and got["world"] == want["world"] == 3
    summary = {"elastic": got, "unbroken": want, "unbroken_seconds": round(unbroken_s, 1),
               "accuracy_gap": got["accuracy"] - want["accuracy"], "loss_gap": got["loss"] - want["loss"]}
    print("elastic check:", json.dumps(summary))
    assert abs(got["accuracy"] - want["accuracy"]) <= 0.01 * want["accuracy"], summary
