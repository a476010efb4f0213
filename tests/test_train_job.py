"""The Ray Train job on a real local Ray (2 workers, gloo): adaptive plans, same plan on
every rank at every step, the guard's dense fallback, and exact resume after a crash."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tests.support.job_runs import last_checkpoint, train
from tests.support.repo import REPO
from tests.support.step_logs import step_logs

# The runs that need no fault of the worker group train in turn in the session's one shared
# Ray Train fit (tests/support/runs_in_turn.py; a fit costs ~20 s of start-up on 2 cores);
# each is its own run, with its own config, run id, output, controller registration and summary.
NAN_STEP, SPIKE_STEP, STABLE = 30, 60, 10
#: the resume tests' config (their uninterrupted reference is trained here, the faulted runs below)
RESUME = ("compression.policy=static", "compression.warmup_steps=0", "workload.epochs=3",
          "compression.static.compressor={name: topk, ratio: 0.05}")
IN_TURN = {
    # the critical policy's plans on every rank, and the learning-rate ramp after compression starts
    "critical": ("workload.lr_schedule=constant", "compression.lr_scaling.enabled=true",
                 "compression.lr_scaling.warmup_steps=20", "compression.lr_scaling.start_factor=0.5"),
    # the other policies end to end (the schedule policy runs in the guard's run)
    **{policy: (f"compression.policy={policy}", "workload.epochs=2", "compression.error_budget.every_steps=10",
                "compression.bandwidth.ratios=[1.0, 0.01]",
                # loopback is fast: only a tiny overlap target makes compression worth it
                "compression.bandwidth.target_overlap=0.001") for policy in ("error_budget", "bandwidth")},
    # stopping at the target; evaluation and report time is not step time; AdamW without lossy rungs
    "stop": ("workload.eval_every_steps=5", "workload.stop_at_target=0.85", "workload.stop_consecutive=2",
             "compression.policy=adaptive", "faults.slow_eval_seconds=0.5", "faults.slow_report_seconds=0.5",
             "workload.optimizer=adamw", "workload.lr=0.0005"),
    # two guard triggers: NaN gradients on rank 1, then a loss spike x1000 on every rank; the
    # schedule policy (Top-K, then int8 from step 25): the guard falls back from whatever plan
    # is in force and returns to it
    "nan": ("compression.policy=schedule", "compression.warmup_steps=0",
            "compression.schedule.stages=[{start_step: 0, compressor: {name: topk, ratio: 0.1}},"
            " {start_step: 25, compressor: {name: int8}}]",
            f"faults.nan_at_step={NAN_STEP}", "faults.nan_rank=1",
            f"faults.loss_scale_at_step={SPIKE_STEP}", "faults.loss_scale=1000",
            f"compression.guard.stable_steps={STABLE}"),
}
#: the resume tests' uninterrupted reference (the resume tests are long checks)
LONG_IN_TURN = {"straight": RESUME}


def test_runs_in_one_training_function_each_start_fresh_from_step_0(in_turn):
    # ray.train.get_checkpoint() returns the previous run's latest checkpoint: raycomp.train
    # must not resume a new run from it
    for name, result in in_turn.items():
        assert result.get("status", "succeeded") == "succeeded", name  # a training function's has none
        totals = result.get("value", result)  # a training function's totals, or a jobs.train summary
        assert totals["restored_from_step"] is None and totals["replayed_steps"] == 0, (name, totals)
        assert all(log[0]["step"] == 0 for log in step_logs(Path(result["output_dir"]))), name


def test_critical_policy_switches_plans_every_rank_uses_the_same_plan_and_lr_ramps(in_turn):
    summary = in_turn["critical"]
    assert summary["status"] == "succeeded"
    assert summary["plan_switches"] >= 3, summary["policy"]
    logs = step_logs(Path(summary["output_dir"]))
    assert len(logs) == 2
    for records in logs:
        assert [r["step"] for r in records] == list(range(summary["steps"]))  # no gap, no repeat
    for mine, theirs in zip(*logs, strict=True):
        assert (mine["plan_version"], mine["plan_digest"]) == (theirs["plan_version"], theirs["plan_digest"])
    assert len({r["plan_version"] for r in logs[0]}) >= 4
    assert summary["compression_ratio"] > 1
    assert summary["wire_bytes_total"] < summary["dense_bytes_total"]
    assert (Path(summary["output_dir"]) / "plot.png").stat().st_size > 10_000
    assert summary["ddp_bucket_cap_mb"] == 1.0  # compression.bucket_cap_mb=auto: the 0.9 MB MLP, one 1 MB bucket
    # the learning rate: the base rate through the dense warm-up, then start_factor x base
    # at the first compressed step, back to the base rate linearly over 20 steps
    records = logs[0]
    start = next(r["step"] for r in records if not r["dense"])
    assert start >= 10  # compression.warmup_steps of the digits config
    assert all(r["lr"] == pytest.approx(0.05) for r in records[:start])
    assert records[start]["lr"] == pytest.approx(0.025)
    assert records[start + 10]["lr"] == pytest.approx(0.0375)
    assert all(r["lr"] == pytest.approx(0.05) for r in records[start + 20:])


def test_nan_gradients_and_an_explosion_fall_back_to_dense_in_the_same_step_and_recover(in_turn):
    summary = in_turn["nan"]
    nan_step, spike_step, stable = NAN_STEP, SPIKE_STEP, STABLE
    assert summary["status"] == "succeeded"
    events = summary["fallback_events"]
    assert events[0] == {"step": nan_step, "kind": "fallback", "reason": "nonfinite_gradient",
                         "detail": "NaN/Inf in gradients or loss"}
    assert events[1]["kind"] == "recovered" and events[1]["step"] == nan_step + stable
    assert (events[2]["step"], events[2]["kind"], events[2]["reason"]) == (spike_step, "fallback", "gradient_explosion")
    assert events[3]["kind"] == "recovered" and events[3]["step"] == spike_step + stable
    assert summary["skipped_steps"] == 2
    for records in step_logs(Path(summary["output_dir"])):
        by_step = {r["step"]: r for r in records}
        for bad in (nan_step, spike_step):
            assert not by_step[bad]["applied"]  # the bad step never reached the weights
            assert not by_step[bad - 1]["dense"]
            # a record holds the plan in force after its step: dense while the guard holds,
            # from the bad step to the last before recovery; the recovery step's record holds
            # the controller's plan, which may already be its own answer to the fallback
            # (dense) or not yet, depending on when that reached the ranks
            assert all(by_step[s]["dense"] and by_step[s]["fallback"] for s in range(bad, bad + stable))
            assert not by_step[bad + stable]["fallback"]
            assert any(not by_step[s]["dense"] for s in range(bad + stable + 1, bad + stable + 11))
    shared = torch.load(Path(summary["checkpoint"]) / "shared.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in shared["model"].values())
    assert summary["final_eval_accuracy"] > 0.5
    assert summary["plan_switches"] >= 1 and summary["final_plan"]["default"] == {"name": "int8"}


@pytest.mark.parametrize("policy", ["error_budget", "bandwidth"])
def test_other_policies_run_end_to_end(in_turn, policy):
    summary = in_turn[policy]
    assert summary["status"] == "succeeded"
    assert summary["plan_switches"] >= 1
    assert summary["final_eval_accuracy"] > 0.5
    details = summary["policy"]["policy_details"]
    if policy == "error_budget":  # the per-layer error profiles reached the DP
        assert details and summary["final_plan"]["layers"], details


# Two faulted runs against one uninterrupted reference (trained in the shared fit): a crash
# while writing an epoch checkpoint resumes from the previous end-of-epoch checkpoint, and a
# killed worker resumes from a mid-epoch step checkpoint. A killed worker resuming from an
# epoch checkpoint is the union of the two (same restore path as the first, same fault as
# the second), so it has no fit of its own.
@pytest.fixture(scope="module")
def uninterrupted(in_turn):
    return in_turn["straight"]


def assert_same_training(crashed: dict, reference: dict) -> None:
    """Bit-identical weights and error-feedback state, and a gap-free step log."""
    assert crashed["status"] == reference["status"] == "succeeded"
    assert crashed["steps"] == reference["steps"] == 66
    for records in step_logs(Path(crashed["output_dir"])):
        assert [r["step"] for r in records] == list(range(66))
    ref_dir, crash_dir = (last_checkpoint(s) for s in (reference, crashed))
    a, b = (torch.load(d / "shared.pt", weights_only=False)["model"] for d in (ref_dir, crash_dir))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for rank in (0, 1):
        ra, rb = (torch.load(d / f"rank{rank}.pt", weights_only=False)["compression"] for d in (ref_dir, crash_dir))
        residuals_a, residuals_b = ra["memory"]["residuals"], rb["memory"]["residuals"]
        assert residuals_a.keys() == residuals_b.keys() and residuals_a
        assert all(torch.equal(residuals_a[k], residuals_b[k]) for k in residuals_a)
        assert ra["step"] == rb["step"] == 66
    assert crashed["final_eval_accuracy"] == reference["final_eval_accuracy"]


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_crash_while_writing_a_checkpoint_resumes_from_the_previous_one(uninterrupted, tmp_path):
    # rank 0 dies after writing rank0.pt of the epoch-1 checkpoint, before shared.pt and
    # before reporting: that half-written checkpoint is never registered or used
    crashed = train(tmp_path, "midsave", *RESUME, "faults.crash_while_checkpointing_epoch=1")
    assert crashed["restored_from_step"] == 22
    assert_same_training(crashed, uninterrupted)


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_step_checkpoints_resume_mid_epoch_and_replay_fewer_than_n_steps(uninterrupted, tmp_path):
    every = 5
    crashed = train(tmp_path, "steps", *RESUME, f"checkpoint.every_steps={every}",
                    "faults.kill_rank_at_step=27", "faults.kill_rank=1", "workload.eval_every_steps=10")
    assert crashed["restored_from_step"] == 25  # the step checkpoint, mid-epoch 1 (steps 22-43)
    # rank 0 finished step 27 (the killed rank's collectives of it were done) and replays 25-27
    assert 1 <= crashed["replayed_steps"] < every
    assert_same_training(crashed, uninterrupted)
    evals = [json.loads(line) for line in (Path(crashed["output_dir"]) / "evals.jsonl").read_text().splitlines()]
    assert {e["step"] for e in evals} == {10, 20, 30, 40, 50, 60, 66}  # every 10 steps, and the end
    assert all({"time", "step", "epoch", "eval_accuracy"} <= e.keys() for e in evals)


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_fashion_mnist_main_job_plans_for_100_mbit_and_says_what_it_chose(ray_cluster, tmp_path, capsys):
    # the main job exactly as scripts/run-job.sh runs it, through jobs.train's main: the
    # adaptive default, planning for 100 Mbit/s (loopback is fast: measured, dense would win)
    from jobs.train import main

    output = tmp_path / "fashion"
    assert main(["--config", str(REPO / "jobs" / "configs" / "fashion_mnist.yaml"), "--output", str(output),
                 "--run-id", f"fashion-{tmp_path.name}"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((output / "summary.json").read_text())
    print(f"fashion adaptive: accuracy {summary['final_eval_accuracy']:.4f}, "
          f"ratio {summary['compression_ratio']:.1f}x, {summary['wall_seconds']:.0f} s")
    assert summary["status"] == "succeeded"
    assert summary["policy"]["name"] == "adaptive"
    details = summary["policy"]["policy_details"]
    assert details["bandwidth_assumed"] and details["bandwidth_bytes_per_s"] == 12.5e6
    assert summary["final_eval_accuracy"] >= 0.85
    # the warm-up's first decision (step 2) sends int8 or int4; later ones keep int4, or go dense
    # where load makes the measured compute dwarf the link
    assert summary["compression_ratio"] > 1.5
    assert summary["policy"]["plan_switches_by_rule"].get("warmup.adaptive.first") == 1
    # the output names the link it planned for, at the start and at the end ...
    assert "policy adaptive: plans for a 100 Mbit/s (12.5 MB/s per rank) link" in printed
    assert ("policy adaptive, planned for a 100 Mbit/s (12.5 MB/s per rank) link "
            "(a planning figure, not this machine's link)") in printed
    # ... the plan in force at the end, by compressor, with the policy's own reason ...
    plan = summary["final_plan"]
    chosen = {spec["name"] for spec in plan["layers"].values()} - {"none"}
    line = next(x for x in printed.splitlines() if x.startswith("  chose at the end: "))
    assert all(name in line for name in chosen) if chosen else line.startswith("  chose at the end: dense"), line
    assert f"(plan v{plan['version']})" in line, line
    assert f"  why: {plan['reason']}" in printed and "link 12.5 MB/s" in plan["reason"]
    assert "[warmup.adaptive.first] warm-up: " in printed  # the first switch, listed with its rule
    # ... every rule that switched plans, and the bytes
    by_rule = next(x for x in printed.splitlines() if x.startswith("  plan switches by rule: "))
    assert all(rule in by_rule for rule in summary["policy"]["plan_switches_by_rule"]), by_rule
    assert f"{summary['compression_ratio']:.1f}x fewer" in printed


def test_stop_at_target_leaves_after_the_second_consecutive_evaluation_on_every_rank(in_turn):
    # that evaluation and report time is not step time: a 0.5 s evaluation every 5 steps would
    # add 0.1 s to the compute of every step the adaptive policy's cost model sees (a digits
    # step computes in milliseconds); an AdamW run registers without the lossy rungs
    summary = in_turn["stop"]
    details = summary["policy"]["policy_details"]
    assert details["compute_s"] is not None and details["compute_s"] < 0.04, details
    assert details["lossy"] is False, details
    output = Path(summary["output_dir"])
    evals = [json.loads(line) for line in (output / "evals.jsonl").read_text().splitlines()]
    after_eval = {e["step"] for e in evals}  # the step that follows each evaluation
    for log in step_logs(output):  # no step's own time holds a 0.5 s evaluation or report
        assert any(r["epoch"] >= 1 for r in log)  # an epoch-end report came before some step
        # counted, every step after an evaluation would take 0.5 s or more; one step slowed
        # by a loaded machine (a control boundary's actor call can pass 0.5 s) is not that
        seconds = [r["seconds"] for r in log if r["step"] in after_eval]
        assert seconds and statistics.median(seconds) < 0.5, [(r["step"], r["seconds"]) for r in log]
        # nor does the first step of an epoch hold the epoch-end report before it (its
        # 0.5 s, and ray.train.report's barrier): counted, every one of them would
        firsts = [r["seconds"] for i, r in enumerate(log) if i and r["epoch"] > log[i - 1]["epoch"]]
        assert firsts and min(firsts) < 0.5, [(r["step"], r["epoch"], r["seconds"]) for r in log]
    held = [i for i in range(1, len(evals))
            if evals[i - 1]["eval_accuracy"] >= 0.85 and evals[i]["eval_accuracy"] >= 0.85]
    assert held, evals
    stop_step = evals[held[0]]["step"]
    assert summary["steps"] == stop_step == evals[-1]["step"]  # no step and no evaluation after it
    assert stop_step < 66  # the digits config trains 66 steps
    assert [len(log) for log in step_logs(output)] == [stop_step, stop_step]  # both ranks stopped there


class _SkipsAHead(torch.nn.Module):
    """Two heads; every other step uses only the first (the same steps on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(128, 10), torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.a(h) + self.b(h) if both else self.a(h)


def _train_skipping_a_head(config: dict) -> dict:
    import ray.train

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection, compressor
    from raycomp.controllers.policies import StaticOptions

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = _SkipsAHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection(policy="static", warmup_steps=2,
                                       static=StaticOptions(compressor=compressor("topk", ratio=0.05))),
        controller=ControllerSection(name=config["controller"], interval_steps=2),
        output_dir=config["output_dir"], run_id=config.get("run_id"), find_unused_parameters=True)
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    gen = torch.Generator().manual_seed(rank)
    loop, compressed = raycomp.train.current(), 0
    # the plan arrives from the controller asynchronously (a loaded machine: many steps
    # later); train until 8 steps ran on it, the same step on every rank
    for _ in loop.epochs(1, 400):
        for step in range(400):
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x, both=step % 2 == 0), y)
            loss.backward()
            compressed += not loop.state.plan.dense and not loop.state.plan.default.is_dense
            raycomp.train.step(loss, samples=len(y))
            if compressed == 8:
                break
    return raycomp.train.finish()


IN_TURN["skips"] = _train_skipping_a_head  # a training function of its own, in the shared fit too


def test_a_model_that_skips_parameters_trains_compressed_with_find_unused_parameters(in_turn):
    # DDP's all-reduce of the used-parameter map runs during backward; the hook's compressed
    # collectives beside it on one group could cross (gloo: a size mismatch, or a hang)
    totals, out = in_turn["skips"]["value"], in_turn["skips"]["output_dir"]
    assert totals["skipped_steps"] == 0
    logs = step_logs(out)
    assert len(logs) == 2 and [r["plan_version"] for r in logs[0]] == [r["plan_version"] for r in logs[1]]
    log = logs[0]
    assert totals["steps"] == len(log) < 400  # stopped after 8 steps on the Top-K plan
    top_k = [i for i, r in enumerate(log) if not r["dense"]]
    assert len(top_k) == 8 and top_k == list(range(top_k[0], len(log)))
    before = log[top_k[0] - 1]
    wire, dense = (log[-1][k] - before[k] for k in ("wire_bytes", "dense_bytes"))
    assert 0 < wire < 0.15 * dense  # Top-K 5%: values and indices, on layers large enough
