"""The controller's logic as a plain object: aggregation, decisions, rejects, snapshots."""

from __future__ import annotations

import json
import shutil

import pytest

from raycomp.controllers.policies import CriticalOptions
from raycomp.controllers.service import Controller
from tests.support.controller_reports import register, report


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
        # complete layer statistics, one value not finite (what a diverging rank measures)
        {**report("r1", 0, 4), "layers": [{**report("r1", 0, 4)["layers"][0], "grad_norm": float("nan")}]},
        {**report("r1", 0, 4), "layers": [{**report("r1", 0, 4)["layers"][1], "compression_error": float("inf")}]},
        {**report("r1", 0, 4), "layers": [{**report("r1", 0, 4)["layers"][2], "residual_norm": float("-inf")}]},
        {**report("r1", 0, 4), "layers": [{**report("r1", 0, 4)["layers"][0], "topk_errors": {"0.1": "x"}}]},
        {**report("r1", 0, 4), "layers": [{"layer": "x"}] * 20_000},
        {**report("r1", 5, 4)},  # rank beyond the world size
        {**report("r1", 0, 4), "skipped_steps": -1},
        {**report("r1", 0, 4), "outer_steps": 1.5},
        {**report("r1", 0, 4), "loss_scale": float("inf")},
        {**report("r1", 0, 4), "loss_scale": 0.0},
        {**report("r1", 0, 4), "lr": -0.1},
        {**report("r1", 0, 4), "lr": float("nan")},
        {**report("r1", 0, 4), "intra_bytes": -1.0},
        {**report("r1", 0, 4), "intra_bytes": float("inf")},
        {**report("r1", 0, 4), "intra_bytes": "4096"},
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
    options = CriticalOptions(window_steps=5).model_dump(mode="json")
    first = Controller(snapshot_dir=str(tmp_path))
    register(first, "run", "critical", options, warmup=0)
    for step, norm, lr in ((4, 1.0, 0.1), (9, 5.0, 0.2), (14, 5.0, 0.05)):
        for rank in (0, 1):
            first.ingest(report("run", rank, step, norm=norm, lr=lr))
    assert (first.summary("run")["lr"], first.summary("run")["peak_lr"]) == (0.05, 0.2)
    first.snapshot()
    saved = [json.loads(path.read_text()) for path in (tmp_path / "runs").glob("*.json")]
    assert [data["run_id"] for data in saved] == ["run"]
    second = Controller(snapshot_dir=str(tmp_path))  # a restarted actor
    assert second.health()["restored"]
    assert second.plan("run", -1) == first.plan("run", -1)
    assert second.summary("run")["policy_details"] == first.summary("run")["policy_details"]
    assert (second.summary("run")["lr"], second.summary("run")["peak_lr"]) == (0.05, 0.2)
    for rank in (0, 1):  # and it keeps steering
        second.ingest(report("run", rank, 19, norm=5.0))
        first.ingest(report("run", rank, 19, norm=5.0))
    assert second.plan("run", -1) == first.plan("run", -1)


def test_corrupt_snapshot_files_are_skipped(tmp_path):
    first = Controller(snapshot_dir=str(tmp_path))
    register(first, "kept")
    register(first, "torn")
    first.store.run_path("torn").write_text("{not json")  # a run file torn by a disk fault
    second = Controller(snapshot_dir=str(tmp_path))
    assert set(second.runs) == {"kept"} and second.health()["restored"]
    (tmp_path / "controller.json").write_text("[]")
    assert set(Controller(snapshot_dir=str(tmp_path)).runs) == {"kept"}


def test_snapshots_save_due_runs_one_at_a_time_changed_plans_first(tmp_path):
    controller = Controller(snapshot_dir=str(tmp_path))
    options = CriticalOptions(window_steps=5).model_dump(mode="json")
    register(controller, "quiet")
    register(controller, "steered", "critical", options, warmup=0)
    assert controller.flush() == 0  # both were saved when registered, nothing changed since
    for rank in (0, 1):
        controller.ingest(report("quiet", rank, 4))
        controller.ingest(report("steered", rank, 4, norm=1.0))
    for rank in (0, 1):
        controller.ingest(report("steered", rank, 9, norm=1.0))  # steady: heavy compression, a new plan
    assert controller._unsaved == {"quiet": False, "steered": True}
    assert controller.flush() == 0  # saved just now (at registration): not yet due
    controller._saved_at = dict.fromkeys(controller._saved_at, -1e9)  # long ago
    assert controller.flush_one() and controller._unsaved == {"quiet": False}  # the changed plan first
    assert controller.flush_one() and not controller._unsaved and not controller.flush_one()
    restored = Controller(snapshot_dir=str(tmp_path))
    assert restored.plan("steered", -1) == controller.plan("steered", -1)
    assert restored.runs["quiet"].reports == 2


def test_a_run_id_never_becomes_a_path(tmp_path):
    controller = Controller(snapshot_dir=str(tmp_path / "snap"))
    register(controller, "../../escape")
    files = list((tmp_path / "snap").rglob("*.json"))
    assert all(f.resolve().is_relative_to((tmp_path / "snap").resolve()) for f in files)
    assert set(Controller(snapshot_dir=str(tmp_path / "snap")).runs) == {"../../escape"}


def test_finished_runs_are_evicted_after_the_grace_period():
    controller = Controller(finished_run_grace_s=0.0)
    register(controller, "old")
    controller.finish_run("old", "succeeded")
    register(controller, "new")  # registration evicts expired runs
    assert "old" not in controller.runs and "new" in controller.runs
    controller.finish_run("new", "succeeded")
    controller.evict()  # and so does the actor's snapshot thread, every tick
    assert not controller.runs


def test_an_evicted_run_leaves_no_snapshot_behind(tmp_path):
    controller = Controller(snapshot_dir=str(tmp_path), finished_run_grace_s=0.0)
    register(controller, "done")
    controller.finish_run("done", "succeeded")
    assert controller.store.run_path("done").exists()
    controller.evict()
    assert not controller.store.run_path("done").exists()
    assert "done" not in Controller(snapshot_dir=str(tmp_path)).runs


def test_reports_taken_out_of_order_keep_the_latest_running_totals():
    controller = Controller()
    register(controller, "r1")
    for rank in (0, 1):  # step 9 of both ranks first, then a delayed step 4
        assert controller.ingest(report("r1", rank, 9, outages=2))
    assert controller.ingest(report("r1", 0, 4, outages=1))
    run = controller.runs["r1"]
    assert run.step == 9 and run.per_rank_bytes[0] == (9000.0, 90000.0)  # not step 4's totals
    assert run.per_rank_outages[0] == 2


@pytest.mark.parametrize("repeat_first", [False, True])
def test_an_evaluation_sent_again_after_its_step_merged_is_taken_without_a_second_timing(repeat_first):
    # a run that ends on a boundary evaluates after it: each rank sends that interval again,
    # with the evaluation; it may even arrive before the boundary's own report
    controller = Controller()
    register(controller, "r1")
    run = controller.runs["r1"]
    first = [report("r1", 1, 9), report("r1", 0, 9), report("r1", 0, 9, eval_metric=0.75)]
    if repeat_first:  # rank 0's repeat, then its boundary report, then rank 1's completes the step
        first = first[::-1]
    for r in first:
        assert controller.ingest(r)
    assert run.step == 9
    assert controller.ingest(report("r1", 1, 9, eval_metric=0.85))
    assert run.eval_metric == pytest.approx(0.8)  # both ranks' evaluations, averaged
    assert run.histograms["step_seconds"].count == 2  # one sample per rank and step
    assert controller.summary("r1")["eval_metric"] == pytest.approx(0.8)
    for rank in (0, 1):  # the next merged step starts over
        controller.ingest(report("r1", rank, 14, eval_metric=0.5 + rank / 10))
    assert run.eval_metric == pytest.approx(0.55) and run.histograms["step_seconds"].count == 4


def test_oversized_reports_are_counted_as_too_large():
    controller = Controller()
    register(controller, "r1")
    layer = report("r1", 0, 4)["layers"][0]
    oversized = [
        {**report("r1", 0, 4), "layers": [layer] * 10_001},
        {**report("r1", 0, 4), "layers": [{**layer, "layer": "x" * 10_000}]},
        {**report("r1", 0, 4), "events": [{"kind": "fallback", "reason": "y" * 10_000}]},
        {**report("r1", 0, 4), "layers": [{**layer, "topk_errors": {str(i): 0.5 for i in range(100)}}]},
    ]
    for item in oversized:
        assert controller.ingest(item) is False
    assert controller.health()["rejected"] == {"too_large": len(oversized)}
    # and a layer with a field no worker sends is malformed, naming it
    assert controller.ingest({**report("r1", 0, 4), "layers": [{**layer, "secret": 1}]}) is False
    assert controller.health()["rejected"]["malformed"] == 1


def test_a_failed_snapshot_write_leaves_the_run_due(tmp_path):
    controller = Controller(snapshot_dir=str(tmp_path / "snap"))
    register(controller, "r1")
    for rank in (0, 1):
        controller.ingest(report("r1", rank, 4))
    controller._saved_at["r1"] = -1e9  # long ago: due
    runs_dir = tmp_path / "snap" / "runs"
    shutil.rmtree(runs_dir)
    runs_dir.write_text("")  # a file where the directory should be: every write fails, even as root
    with pytest.raises(OSError):
        controller.flush_one()
    assert "r1" in controller._unsaved  # still due
    runs_dir.unlink()
    assert controller.flush_one() and "r1" not in controller._unsaved
    assert Controller(snapshot_dir=str(tmp_path / "snap")).runs["r1"].reports == 2


def test_a_policy_that_returns_a_bare_plan_is_refused_in_one_line():
    from raycomp.controllers.policies import Policy, register_policy, unregister_policy
    from raycomp.plan import Plan

    class Bare(Policy):
        name = "bare"

        def decide(self, run):
            return Plan(reason="bare")

    register_policy("bare", Bare)
    try:
        controller = Controller()
        with pytest.raises(TypeError, match=r"^policy 'bare': decide/warmup must return a Decision .* got Plan$"):
            controller.register_run("r", 2, {"w": [64, 64]}, "bare", {}, 0, 5, 1024)
    finally:
        unregister_policy("bare")
