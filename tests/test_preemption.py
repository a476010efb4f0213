"""A preemption notice turned into a checkpoint (long check), on a cluster of two nodes on this
machine (tests/support/elastic_run.py), ``ScalingConfig(num_workers=(1, 2))``.

Mid-run the second node is drained with the preemption reason (``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION``), as a cloud's autoscaler announces a spot node's end; the
ranks train on. At the next agreement of the ranks after Ray Train hands a worker the notice
(it rides in the agreement's all-gather), every rank checkpoints, once, and trains on; then the node is killed, and the run resumes
from that checkpoint on the remaining worker and finishes its step budget. No periodic
checkpoint is configured: without the notice's the restart would start from step 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[1]
STEPS, DRAIN_AFTER, KILL_AFTER, K = 100, 30, 55, 5
SPEC = {"nodes": 2, "cpus": 1, "min_workers": 1, "max_workers": 2, "max_failures": 3, "steps": STEPS,
        "every_steps": None, "batch": 96, "compressor": ["topk", {"ratio": 0.1}], "monitor_s": 5,
        "gate_timeout_s": 240, "step_sleep_s": 0.05, "drain_deadline_s": 20,
        "drill": {"drain_after_step": DRAIN_AFTER, "kill_after_step": KILL_AFTER}}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def drill(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("preemption")
    output = work / "run"
    spec = work / "spec.json"
    spec.write_text(json.dumps({**SPEC, "output": str(output), "name": f"preempt-{work.name}"[:60]}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    env.pop("RAY_ADDRESS", None)
    with open(work / "driver.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "tests.support.elastic_run", str(spec)], env=env, cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, timeout=1200, check=False)
    driver = json.loads((output / "driver.json").read_text())
    assert done.returncode == 0 and driver["status"] == "succeeded", (driver, (work / "driver.log").read_text()[-3000:])
    return output


def test_a_drained_node_s_notice_is_checkpointed_once_by_every_rank_at_one_agreement(drill):
    from raycomp._internal.train.plan_handoff import ANSWER_STEPS

    driver = json.loads((drill / "driver.json").read_text())
    drains = [e for e in driver["events"] if e["event"] == "drain"]
    assert len(drains) == 1 and drains[0]["rc"] == 0, drains
    notices = _lines(drill / "notices.jsonl")
    assert sorted(n["rank"] for n in notices) == [0, 1], notices  # each rank once, in the group of two
    steps = {n["step"] for n in notices}
    assert len(steps) == 1, notices  # the same boundary on every rank
    (step,) = steps
    # the agreement ANSWER_STEPS after a boundary, where the notice rode in the all-gather
    assert DRAIN_AFTER < step <= KILL_AFTER and (step - ANSWER_STEPS) % K == 0
    assert len({n["asked"] for n in notices}) == 1  # both had asked as often


def test_the_run_resumes_from_the_notice_s_checkpoint_and_finishes(drill):
    (step,) = {n["step"] for n in _lines(drill / "notices.jsonl")}
    starts = _lines(drill / "starts.jsonl")
    restarts = [s for s in starts if s["restored_from"] is not None]
    assert restarts and {s["world"] for s in restarts} == {1}
    assert restarts[0]["restored_from"] == step  # the notice's checkpoint, not step 0
    result = json.loads((drill / "result.json").read_text())
    assert result["steps"] == STEPS and result["accuracy"] > 0.8
    lost = KILL_AFTER - step  # steps trained after the checkpoint, replayed after the restart
    (drill / "lost_steps.json").write_text(json.dumps({"notice_step": step, "kill_step": KILL_AFTER, "lost": lost}))
