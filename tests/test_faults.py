"""Faults on a real local Ray: the controller dies (and comes back, or not), ranks
disagree on the plan, a rank stops communicating. Training goes on or fails clearly and
quickly — never hangs. (NaN and exploding gradients: tests/test_train_job.py; the plan
check at a control boundary on two gloo processes: tests/test_plan_agreement.py.) All but the
placement-group test are long checks (scripts/long-checks.sh)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray

from tests.support.job_runs import train
from tests.support.step_logs import step_logs


def kill_controller_when(output: Path, step: int, name: str, restart: bool, namespace: str = "raycomp"):
    """Background thread: once rank 0 has logged ``step``, kill the named controller."""
    killed: dict = {}

    def watch() -> None:
        log = output / "steps" / "rank0.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if log.exists() and log.read_text().count("\n") >= step:
                actor = ray.get_actor(name, namespace=namespace)
                killed["pid"] = ray.get(actor.pid.remote())
                ray.kill(actor, no_restart=not restart)
                killed["at"] = time.monotonic()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_controller_restart_workers_keep_training_and_it_resumes_steering(ray_cluster, tmp_path):
    name = f"ctl-restart-{tmp_path.name}"[:60]
    thread, killed = kill_controller_when(tmp_path / "run", 25, name, restart=True)
    # 528 steps: the run goes on for seconds after the restarted actor's first answer (half
    # as many left too short a margin, which one CI run missed)
    summary = train(tmp_path, "run", f"controller.name={name}", "controller.interval_steps=2",
                    "workload.batch_size=16", "workload.epochs=12")
    thread.join(timeout=5)
    assert "pid" in killed, "the controller was never killed"
    assert summary["status"] == "succeeded" and summary["steps"] == 528
    assert summary["controller_outages"] >= 1  # calls in flight at the kill failed and were counted
    actor = ray.get_actor(name, namespace="raycomp")
    health = ray.get(actor.health.remote())
    assert health["restored"], "the restarted controller did not restore its snapshot"
    assert ray.get(actor.pid.remote()) != killed["pid"]
    # it kept steering the same run: reports after the restart were merged into it
    assert summary["policy"]["last_step"] >= 500
    assert summary["policy"]["reports"] > 0
    for mine, theirs in zip(*step_logs(Path(summary["output_dir"])), strict=True):
        assert mine["plan_version"] == theirs["plan_version"]


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_controller_down_for_good_training_finishes_with_a_warning(ray_cluster, tmp_path):
    name = f"ctl-dead-{tmp_path.name}"[:60]
    thread, killed = kill_controller_when(tmp_path / "run", 25, name, restart=False)
    summary = train(tmp_path, "run", f"controller.name={name}", "workload.steps_per_epoch=20",
                    "workload.epochs=3")
    thread.join(timeout=5)
    assert "pid" in killed
    assert summary["status"] == "succeeded" and summary["steps"] == 60
    assert summary["controller_outages"] >= 1
    assert any("controller unreachable" in w for w in summary["warnings"]), summary["warnings"]
    assert summary["final_eval_accuracy"] > 0.5


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_forced_plan_disagreement_fails_clearly_within_the_interval(ray_cluster, tmp_path):
    started = time.monotonic()
    summary = train(tmp_path, "run", "faults.force_plan_mismatch_at_step=20", "checkpoint.max_failures=0")
    assert summary["status"] == "failed"
    assert "PlanMismatchError" in summary["error"] and "ranks disagree on the plan" in summary["error"]
    assert time.monotonic() - started < 120
    for records in step_logs(Path(summary["output_dir"])):
        assert max(r["step"] for r in records) < 20 + 5  # stopped at the first boundary after


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_a_rank_that_stops_communicating_fails_by_the_timeout_not_a_hang(ray_cluster, tmp_path):
    started = time.monotonic()
    summary = train(tmp_path, "run", "faults.hang_rank_at_step=15", "faults.hang_rank=1",
                    "scaling.collective_timeout_s=10", "checkpoint.max_failures=0")
    elapsed = time.monotonic() - started
    assert summary["status"] == "failed"
    assert "timed out" in summary["error"].lower() or "timeout" in summary["error"].lower(), summary["error"]
    assert elapsed < 150, f"took {elapsed:.0f} s"


def test_controller_created_inside_a_placement_group_outlives_it(ray_cluster, tmp_path):
    """A Tune trial runs in a placement group that captures its children; the controller
    service it creates must not die when that group is removed. The plain actor beside it
    is the control: created the same way without the "DEFAULT" strategy, it dies."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raycomp.controllers.service import get_or_create

    name, control_name = f"pg-controller-{tmp_path.name}", f"pg-control-{tmp_path.name}"

    @ray.remote(num_cpus=0)
    class Plain:
        def ping(self) -> str:
            return "pong"

    @ray.remote(num_cpus=0.01)
    def trial() -> None:
        ray.get(get_or_create(name, "raycomp-test", str(tmp_path)).health.remote())
        ray.get(Plain.options(name=control_name, namespace="raycomp-test", lifetime="detached").remote()
                .ping.remote())

    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=60)
    ray.get(trial.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_capture_child_tasks=True)).remote(), timeout=120)
    remove_placement_group(group)

    deadline = time.monotonic() + 30
    control_died = False
    while time.monotonic() < deadline and not control_died:
        try:
            ray.get(ray.get_actor(control_name, namespace="raycomp-test").ping.remote(), timeout=5)
            time.sleep(0.2)
        except (ValueError, ray.exceptions.RayActorError):  # no longer named / dead
            control_died = True
    assert control_died, "the control actor survived its placement group: the test has no teeth"
    controller = ray.get_actor(name, namespace="raycomp-test")
    try:
        assert ray.get(controller.health.remote(), timeout=30)
    finally:
        ray.kill(controller, no_restart=True)


def test_the_injected_step_takes_what_the_loops_step_takes(tmp_path):
    """raycomp.train.step calls ``loop.step(loss, samples, clip_grad_norm)``: a drill's wrapper
    (jobs.faults) must take and pass on the same arguments, or every kill and hang drill dies
    of a TypeError at its first step instead of the fault it injects."""
    import inspect

    from jobs.faults import FaultInjector, FaultsSection
    from raycomp._internal.train.loop import TrainLoop

    calls = []

    class Loop:
        global_step = 0

        def step(self, loss, samples=0, clip_grad_norm=None):
            calls.append((loss, samples, clip_grad_norm))
            return True

    loop = Loop()
    FaultInjector(FaultsSection(kill_rank_at_step=5, kill_rank=1), 0, tmp_path).install(loop)
    assert loop.step(1.0, 32, 0.5) is True and calls == [(1.0, 32, 0.5)]
    wrapper = list(inspect.signature(loop.step).parameters)
    assert wrapper == list(inspect.signature(TrainLoop.step).parameters)[1:]  # less self
