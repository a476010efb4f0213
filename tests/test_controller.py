"""The controller's logic as a plain object: aggregation, decisions, rejects, snapshots."""

from __future__ import annotations

import json

from controllers.service import Controller
from raycomp.config import CriticalPolicy, StaticPolicy

LAYERS = {"fc1.weight": 32768, "fc2.weight": 5120, "fc1.bias": 512}


def report(run_id: str, rank: int, step: int, loss: float = 1.0, norm: float = 1.0, **extra) -> dict:
    layers = [{"layer": name, "compressor": "topk", "numel": n, "grad_norm": norm, "compression_error": 0.9,
               "residual_norm": 0.1, "wire_bytes": 100.0, "dense_bytes": 1000.0} for name, n in LAYERS.items()]
    return {"run_id": run_id, "rank": rank, "step": step, "epoch": 0, "plan_version": 0, "loss": loss,
            "step_seconds": 0.1, "compute_seconds": 0.08, "comm_seconds": 0.02, "samples_per_second": 640.0,
            "wire_bytes": 1000.0 * step, "dense_bytes": 10000.0 * step, "layers": layers, **extra}


def register(controller: Controller, run_id: str, policy: str = "static", options=None, warmup: int = 10):
    options = options or StaticPolicy().model_dump(mode="json")
    return controller.register_run(run_id, 2, LAYERS, policy, options, warmup, 5, 1024)


def test_warm_up_then_policy_plan_once_all_ranks_reported():
    controller = Controller()
    assert register(controller, "r1")["default"] == {"name": "none"}
    for step in (4, 9):
        controller.ingest(report("r1", 0, step))
        assert controller.plan("r1", 0) is None  # rank 1 missing: nothing merged yet
        controller.ingest(report("r1", 1, step))
    plan = controller.plan("r1", 0)
    assert plan["version"] == 1 and plan["default"] == {"name": "topk", "ratio": 0.01}
    assert controller.plan("r1", 1) is None  # nothing newer than what the caller holds
    controller.ingest(report("r1", 0, 14))
    controller.ingest(report("r1", 1, 14))
    assert controller.plan("r1", 1) is None  # the same decision is not a new version
    assert controller.summary("r1")["plan_switches"] == 1


def test_no_warm_up_decides_at_registration():
    controller = Controller()
    assert register(controller, "r0", warmup=0)["default"]["name"] == "topk"


def test_malformed_reports_are_rejected_counted_and_harmless():
    controller = Controller()
    register(controller, "r1")
    bad = [
        "not a dict",
        {**report("r1", 0, 4), "loss": float("nan")},
        {**report("r1", 0, 4), "rank": -1},
        {**report("r1", 0, 4), "step": "four"},
        {**report("r1", 0, 4), "extra_field": 1},
        {**report("r1", 0, 4), "layers": [{"layer": "fc1.weight", "grad_norm": float("inf")}]},
        {**report("r1", 0, 4), "layers": [{**report("r1", 0, 4)["layers"][0], "topk_errors": {"0.1": "x"}}]},
        {**report("r1", 0, 4), "layers": [{"layer": "x"}] * 20_000},
        {**report("r1", 5, 4)},  # rank beyond the world size
    ]
    for item in bad:
        assert controller.ingest(item) is False
    assert controller.ingest(report("nope", 0, 4)) is False
    health = controller.health()
    assert health["rejected"]["unknown_run"] == 1
    assert sum(health["rejected"].values()) == len(bad) + 1
    # still serving
    controller.ingest(report("r1", 0, 9))
    controller.ingest(report("r1", 1, 9))
    assert controller.plan("r1", 0)["version"] == 1


def test_snapshot_restores_runs_and_policy_state(tmp_path):
    options = CriticalPolicy(window_steps=5).model_dump(mode="json")
    first = Controller(snapshot_dir=str(tmp_path))
    register(first, "run", "critical", options, warmup=0)
    for step, norm in ((4, 1.0), (9, 5.0), (14, 5.0)):
        for rank in (0, 1):
            first.ingest(report("run", rank, step, norm=norm))
    first.snapshot(force=True)
    data = json.loads((tmp_path / "controller.json").read_text())
    assert "run" in data["runs"]
    second = Controller(snapshot_dir=str(tmp_path))  # a restarted actor
    assert second.health()["restored"]
    assert second.plan("run", -1) == first.plan("run", -1)
    assert second.summary("run")["policy_details"] == first.summary("run")["policy_details"]
    for rank in (0, 1):  # and it keeps steering
        second.ingest(report("run", rank, 19, norm=5.0))
        first.ingest(report("run", rank, 19, norm=5.0))
    assert second.plan("run", -1) == first.plan("run", -1)


def test_corrupt_snapshot_starts_empty(tmp_path):
    (tmp_path / "controller.json").write_text("{not json")
    assert Controller(snapshot_dir=str(tmp_path)).health()["runs"] == 0


def test_finished_runs_are_evicted_after_the_grace_period():
    controller = Controller(finished_run_grace_s=0.0)
    register(controller, "old")
    controller.finish_run("old", "succeeded")
    register(controller, "new")  # registration evicts expired runs
    assert "old" not in controller.runs and "new" in controller.runs
