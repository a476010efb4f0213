"""Local steps through ``raycomp.train`` on a real local Ray (2 workers, gloo): the plan's mode
switches every rank at the same step, inner steps send nothing, syncs send compressed
pseudo-gradients and leave every rank with the same weights, the guard judges syncs and
steps back to dense per step, and a worker killed mid-interval resumes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.support import same_on_every_rank
from tests.support.job_runs import last_checkpoint, train
from tests.support.repo import REPO
from tests.support.step_logs import step_logs

H = 4
SPIKE_STEP = 29  # the loss reported at this step is multiplied by 1000 on every rank


def _train_step(model: torch.nn.Module, gen: torch.Generator) -> None:
    """One step of this rank's own batch of 16 through ``raycomp.train.step``."""
    import raycomp.train

    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    raycomp.train.step(loss, samples=len(y))


def _prepared(config: dict, hidden: int, momentum: float = 0.0, **compression) -> tuple[int, torch.nn.Module]:
    """An MLP of ``hidden`` units through ``raycomp.train.prepare_model`` with local steps
    every H steps, int8 pseudo-gradients, after ``compression``'s other settings (the
    static int8 policy; a boundary every 2 steps), SGD with ``momentum``; this rank's number
    and the model."""
    import ray.train

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection, compressor
    from raycomp.controllers.policies import StaticOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection(policy="static", static=StaticOptions(compressor=compressor("int8")),
                                       **compression),
        controller=ControllerSection(name=config["controller"], interval_steps=2),
        output_dir=config["output_dir"], run_id=config.get("run_id"))
    return ray.train.get_context().get_world_rank(), raycomp.train.prepare_model(model, optimizer, options=options)


def _train_local(config: dict) -> dict:
    import raycomp.train
    from raycomp.config import GuardSection, LocalSection
    from tests.support.wire import WireRecorder

    # momentum: each replica's own during local steps, made equal again when they end
    rank, model = _prepared(
        config, 128, momentum=0.9, warmup_steps=4, guard=GuardSection(stable_steps=6, loss_spike_factor=3.0),
        # each sync waited for at once (not the default's one step on the wire), so that
        # every sync leaves the ranks with equal weights
        local=LocalSection(mode="fixed", sync_every=H, compressor="int8", delay=0))
    loop = raycomp.train.current()
    gen = torch.Generator().manual_seed(rank)
    records = []
    with WireRecorder() as wire:
        for _ in loop.epochs(1, 60):
            for step in range(60):
                mark = wire.mark()
                x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                outer_before, local_before = loop.strategy.state.steps.outer_steps, not loop.strategy.per_step
                # the loss the guard is told of jumps at one step (the gradient does not)
                raycomp.train.step(loss * (1000.0 if step == SPIKE_STEP else 1.0), samples=len(y))
                sent = sum(c.transmitted for c in wire.since(mark))
                # a step in local steps from start to end (not one that entered or left them)
                local = local_before and not loop.strategy.per_step
                records.append({"step": step, "local": local, "after": not loop.strategy.per_step, "sent": sent,
                                "synced": loop.strategy.state.steps.outer_steps > outer_before,
                                "weights": [p.detach().clone() for p in model.parameters()]})
    # the test's own check, after training: which steps left the ranks with equal weights
    for r in records:
        r["equal"] = same_on_every_rank(r.pop("weights"))
    totals = raycomp.train.finish()
    return {**totals, "records": records}


def _train_local_delay(config: dict) -> dict:
    """Local steps with the default delay (a sync kept on the wire for one inner step): at the
    first step that ends with a sync in flight, the counts of outer steps (the loop's, local
    steps') before and after ``TrainLoop.save_state``; at the second, the same around the
    frameworks' :func:`raycomp.integrations.state_files.save_state` (Lightning, the Hugging
    Face Trainer); the run then ends with another in flight."""
    import tempfile

    import raycomp.train
    from raycomp.config import LocalSection
    from raycomp.integrations import state_files

    rank, model = _prepared(config, 32, warmup_steps=0, local=LocalSection(mode="fixed", sync_every=H,
                                                                            compressor="int8"))
    loop = raycomp.train.current()
    steps = loop.strategy.state.steps
    gen = torch.Generator().manual_seed(rank)
    saved = framework = None
    in_flight = 0

    def around(save) -> dict:
        before = (loop.outer_steps, steps.outer_steps)
        with tempfile.TemporaryDirectory() as tmp:
            save(Path(tmp))
        return {"before": before, "after": (loop.outer_steps, steps.outer_steps), "quiescent": steps.quiescent}

    for _ in loop.epochs(1, 40):
        for _ in range(40):
            _train_step(model, gen)
            if loop.strategy.per_step or steps.quiescent:
                continue
            in_flight += 1
            if saved is None:
                saved = around(loop.save_state)
            elif framework is None:
                framework = around(lambda directory: state_files.save_state(loop, directory))
            elif in_flight >= 3:
                break  # with a sync on the wire
        break
    at_end, outer_at_end = not steps.quiescent, steps.outer_steps
    totals = raycomp.train.finish()
    # after finish (the test's own check): whether the ranks hold the same weights
    equal = same_on_every_rank(list(model.parameters()))
    return {"saved": saved, "framework": framework, "in_flight_at_end": at_end, "outer_steps": totals["outer_steps"],
            "local_outer_steps": steps.outer_steps, "local_outer_at_end": outer_at_end,
            "equal_after_finish": equal, "quiescent_after_finish": steps.quiescent}


def _train_local_to_the_end(config: dict) -> dict:
    """Local steps with the default delay to the end of ``loop.epochs``: after the loop (where a
    job evaluates, reports and checkpoints) and before ``finish``, whether the ranks hold the
    same weights, then the outer steps before and after ``finish``."""

    import raycomp.train
    from raycomp.config import LocalSection

    rank, model = _prepared(config, 32, warmup_steps=0, local=LocalSection(mode="fixed", sync_every=H,
                                                                            compressor="int8"))
    loop = raycomp.train.current()
    steps = loop.strategy.state.steps
    gen = torch.Generator().manual_seed(rank)
    apart = 0  # steps in local steps after which the ranks' weights differed
    for _ in loop.epochs(1, 24):
        for _ in range(24):
            _train_step(model, gen)
            apart += not loop.strategy.per_step and not same_on_every_rank(list(model.parameters()))
    equal_at_end = same_on_every_rank(list(model.parameters()))
    before, wire = (loop.outer_steps, steps.outer_steps), loop.state.ledger.wire_total
    totals = raycomp.train.finish()
    return {"apart": apart, "local_at_end": not loop.strategy.per_step, "equal_at_end": equal_at_end,
            "quiescent_at_end": steps.quiescent, "before_finish": before,
            "after_finish": (totals["outer_steps"], steps.outer_steps),
            "finish_sent": loop.state.ledger.wire_total - wire}


@pytest.fixture(scope="module")
def local_run(in_turn):
    return in_turn["local"]["value"], in_turn["local"]["output_dir"]


def test_inner_steps_send_nothing_and_syncs_leave_every_rank_with_the_same_weights(local_run):
    totals, tmp = local_run
    records = totals["records"]
    assert not any(r["local"] for r in records[:4])  # the dense warm-up, per step
    local = [r for r in records if r["local"]]
    assert len(local) >= 30
    synced = [r for r in local if r["synced"]]
    inner = [r for r in local if not r["synced"]]
    assert synced and inner
    assert all(r["equal"] for r in synced)  # the outer step: the same global weights everywhere
    assert totals["outer_steps"] == sum(r["synced"] for r in records)  # what the controller is told
    assert sum(not r["equal"] for r in inner) >= len(inner) // 2  # replicas drift in between
    # an inner step sends nothing but the control boundary's few bytes; a sync sends the
    # int8 pseudo-gradients, about a quarter of the per-step dense all-reduce of the warm-up
    dense_step = min(r["sent"] for r in records[:4])
    assert dense_step > 35_000  # the 9.6k-parameter MLP's fp32 all-reduce
    assert max(r["sent"] for r in inner) < 0.02 * dense_step
    assert all(0.2 * dense_step < r["sent"] < 0.4 * dense_step for r in synced)
    logs = step_logs(tmp)
    assert [r["plan_digest"] for r in logs[0]] == [r["plan_digest"] for r in logs[1]]


def test_the_guard_judges_a_sync_falls_back_to_dense_per_step_and_returns_to_local_steps(local_run):
    totals, _ = local_run
    events = totals["fallback_events"]
    assert [e["kind"] for e in events] == ["fallback", "recovered"]
    assert events[0]["reason"] == "loss_spike"
    # judged at the first sync after the spike (the mean loss of its interval), not before
    assert SPIKE_STEP <= events[0]["step"] < SPIKE_STEP + H
    records = totals["records"]
    fallback, recovered = events[0]["step"], events[1]["step"]
    assert all(r["equal"] for r in records[fallback + 1:recovered + 1])  # left local steps merged
    assert not any(r["after"] for r in records[fallback:recovered + 1])  # dense, per step
    assert any(r["local"] for r in records[recovered + 1:])  # and back to local steps


# A worker killed mid-interval resumes bit for bit: jobs.train on the digits config, local
# steps from the first step (no warm-up), a step checkpoint every 5 steps, rank 1 killed at
# step 27 (three inner steps into an interval of 4), against the same run uninterrupted.
RESUME = ("compression.policy=static", "compression.warmup_steps=0", "workload.epochs=2",
          "compression.local.mode=fixed", f"compression.local.sync_every={H}", "compression.local.compressor=int4",
          "checkpoint.every_steps=5")


#: trained in the session's shared fit (tests/support/runs_in_turn.py): the run of the first
#: two tests, and the resume test's uninterrupted reference (a long check)
IN_TURN = {"local": _train_local, "local_delay": _train_local_delay, "local_to_the_end": _train_local_to_the_end}
LONG_IN_TURN = {"straight": RESUME}


@pytest.fixture(scope="module")
def local_reference(in_turn):
    return in_turn["straight"]


def assert_same_local_training(crashed: dict, reference: dict) -> None:
    """Every rank's own weights, the shared weights and the residuals bit for bit."""
    assert crashed["steps"] == reference["steps"] == 44
    ref_dir, crash_dir = (last_checkpoint(s) for s in (reference, crashed))
    for rank in (0, 1):
        a, b = (torch.load(d / f"rank{rank}.pt", weights_only=False) for d in (ref_dir, crash_dir))
        assert a["compression"]["mode"] == {"sync_every": H, "fragments": 1}
        la, lb = a["compression"]["local"], b["compression"]["local"]
        assert la["inner_steps"] == lb["inner_steps"] == 44
        assert all(torch.equal(x, y) for x, y in zip(la["global"], lb["global"], strict=True))
        residuals = la["reducer"]["memory"]["residuals"]
        assert residuals and all(torch.equal(residuals[k], lb["reducer"]["memory"]["residuals"][k])
                                 for k in residuals)
        ma, mb = a["replica"]["model"], b["replica"]["model"]  # this rank's own weights
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert crashed["final_eval_accuracy"] == reference["final_eval_accuracy"]
    evals = (Path(crashed["output_dir"]) / "evals.jsonl").read_text().splitlines()
    assert json.loads(evals[-1])["step"] == 44


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_a_worker_killed_mid_interval_resumes_bit_for_bit(local_reference, tmp_path):
    crashed = train(tmp_path, "killed", *RESUME, "faults.kill_rank_at_step=27", "faults.kill_rank=1")
    assert crashed["restored_from_step"] == 25
    assert_same_local_training(crashed, local_reference)


@pytest.mark.long  # a collective timeout and a worker-group restart: scripts/long-checks.sh
def test_an_outage_longer_than_the_collective_timeout_restarts_from_the_checkpoint_and_loses_nothing(
        local_reference, tmp_path):
    # rank 1 goes silent for 15 s at step 27 (its link down): rank 0's next collective (the
    # sync after step 27) times out after 8 s, the worker group restarts from the step-25
    # checkpoint and the run ends where the uninterrupted one does
    crashed = train(tmp_path, "outage", *RESUME, "faults.hang_rank_at_step=27", "faults.hang_rank=1",
                    "faults.hang_seconds=15", "scaling.collective_timeout_s=8")
    assert crashed["restored_from_step"] == 25
    assert_same_local_training(crashed, local_reference)


def test_local_steps_are_refused_with_fsdp_before_anything_starts(tmp_path):
    from jobs.config import JobConfig
    from jobs.train import prepare

    with pytest.raises(ValueError, match=r"compression.local.mode: 'fixed' is not available with "
                                         r"scaling.strategy=fsdp.*allowed: off"):
        prepare(["--config", str(REPO / "jobs" / "configs" / "digits.yaml"), "--output", str(tmp_path),
                 "scaling.strategy=fsdp", "compression.local.mode=fixed"], JobConfig)


def _local_state(**section) -> tuple[torch.nn.Module, object]:
    """The test model in DDP and the :class:`~raycomp._internal.train.local_strategy.LocalState` of a run
    with ``compression.local`` set to ``section`` (on every rank: the constructor broadcasts)."""
    from raycomp._internal.ddp.hook import CompressionState
    from raycomp._internal.local import LocalSteps
    from raycomp._internal.train.local_strategy import LocalState
    from raycomp.config import LocalSection
    from tests.support.local_model import small_model

    model = small_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return model, LocalState(ddp, CompressionState(ddp), LocalSteps(model, sync_every=H), LocalSection(**section))


def _leave_mid_interval(rank: int, world: int) -> tuple[bool, bool]:
    """Two inner steps of H=4 on each rank's own data, then a per-step plan is installed (the
    controller or the guard leaving local steps between two syncs)."""
    from raycomp.plan import LocalMode, Plan
    from tests.support.local_model import inner_step
    from tests.support.ranks import flat, gather

    model, state = _local_state(mode="fixed", sync_every=H)
    state.set_plan(Plan(local=LocalMode(H)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        inner_step(model, opt, rank, step)
        state.steps.step()
    apart = len({tuple(t.tolist()) for t in gather(flat(model.parameters()))}) > 1
    state.set_plan(Plan())  # per step again
    together = len({tuple(t.tolist()) for t in gather(flat(model.parameters()))}) == 1
    return apart, together


def test_leaving_local_steps_between_syncs_merges_the_replicas_first():
    from tests.distributed import run_distributed

    assert run_distributed(_leave_mid_interval, 2) == [(True, True), (True, True)]


def _default_delay(rank: int, world: int) -> list[tuple[int, bool]]:
    """The run's LocalState with the section's defaults: per H installed, the schedule's
    delay, and whether the sync started after H inner steps is still on the wire then."""
    from raycomp.plan import LocalMode, Plan
    from tests.support.local_model import inner_step

    model, state = _local_state(mode="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for mode in (LocalMode(H), LocalMode(1), LocalMode(H, fragments=H)):
        state.set_plan(Plan(local=mode))
        for step in range(mode.sync_every // mode.fragments):
            inner_step(model, opt, rank, step)
            state.steps.step()
        seen.append((state.steps.schedule.delay, not state.steps.quiescent))
    return seen


def test_by_default_the_delay_keeps_a_sync_on_the_wire_for_one_inner_step_where_h_allows():
    from tests.distributed import run_distributed

    # H=4: the first sync is still in flight after its 4th inner step; H=1 and four
    # fragments of H=4 (syncs one step apart) wait for theirs at once
    expected = [(1, True), (0, False), (0, False)]
    assert run_distributed(_default_delay, 2) == [expected, expected]


def test_a_sync_on_the_wire_is_drained_counted_and_judged_before_a_checkpoint_and_the_totals(in_turn):
    out = in_turn["local_delay"]["value"]
    # save_state finished the sync on the wire, and the loop counted it (as the guard judged
    # it) before writing: a run resumed from those files finds it done, as this run does. The
    # frameworks' checkpoint hook (Lightning, the Hugging Face Trainer) does the same
    for saved in (out["saved"], out["framework"]):
        assert saved["quiescent"]
        assert saved["before"][0] == saved["before"][1] and saved["after"][1] == saved["before"][1] + 1
        assert saved["after"][0] == saved["after"][1]
    assert out["framework"]["after"][1] == out["saved"]["after"][1] + 1  # the next sync
    # the run ended mid-epoch with a sync on the wire: finish lands it and merges the ranks'
    # weights with one more sync (the model every rank ends with is one); the totals count both
    assert out["in_flight_at_end"] and out["outer_steps"] == out["local_outer_steps"]
    assert out["local_outer_steps"] == out["local_outer_at_end"] + 2
    assert out["equal_after_finish"] and out["quiescent_after_finish"]


def test_the_last_step_of_the_epochs_merges_the_replicas_and_finish_sends_nothing_more(in_turn):
    out = in_turn["local_to_the_end"]["value"]
    # with a sync kept on the wire, the ranks' weights differ after every step of local steps
    # (each keeps its own inner step on top of a merge), except after the last one: it drains
    # the sync on the wire and merges every fragment, so what the job then evaluates, reports
    # and saves is one model on every rank
    assert out["local_at_end"] and out["apart"] >= 15
    assert out["equal_at_end"] and out["quiescent_at_end"]
    assert out["before_finish"][0] == out["before_finish"][1]  # the merge is counted
    # finish finds the ranks merged: no sync, no outer step on the outer momentum
    assert out["after_finish"] == out["before_finish"] and out["finish_sent"] == 0


def _drained_rows(rank: int, world: int) -> list:
    """LocalStepsStrategy with the default delay, H=4, each rank's loss 1 + rank: what
    ``after_optimizer_step`` and ``drain`` return, step by step."""
    from raycomp._internal.train.local_strategy import LocalStepsStrategy
    from raycomp.plan import LocalMode, Plan
    from tests.support.local_model import inner_step

    model, state = _local_state(mode="fixed", sync_every=H)
    strategy = LocalStepsStrategy(state.model, state)
    strategy.state.set_plan(Plan(local=LocalMode(H)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(2 * H + 1):
        inner_step(model, opt, rank, step)
        seen.append(strategy.after_optimizer_step(True, 1.0 + rank))
        if step == H - 1:  # the first strategy is on the wire: drained (a checkpoint)
            seen.append(("drain", strategy.drain(), strategy.state.steps.quiescent))
    return seen


def test_a_drained_sync_hands_its_rows_over_once_and_the_next_sync_its_own():
    from tests.distributed import run_distributed

    rows = [[0.0, 1.0, 1.0], [0.0, 2.0, 1.0]]  # [non-finite, mean loss since the last sync, has loss]
    expected = [None] * H + [("drain", rows, True)] + [None] * H + [rows]
    assert run_distributed(_drained_rows, 2) == [expected, expected]


def _skipped_sync_rows(rank: int, world: int) -> tuple[list, bool, bool, str]:
    """LocalStepsStrategy over dense pseudo-gradients (no compressed layer: no rank flags its own row),
    H=4, each rank's loss 1 + rank; before the first sync rank 1's first bias turns NaN. The
    rows the sync hands over, and the guard's verdict on them."""
    from raycomp._internal.guard import Guard
    from raycomp._internal.train.local_strategy import LocalStepsStrategy
    from raycomp._internal.train.step_judge import StepJudge
    from raycomp.plan import LocalMode, Plan
    from tests.support.local_model import inner_step

    model, state = _local_state(mode="fixed", sync_every=H, delay=0)
    strategy = LocalStepsStrategy(state.model, state)
    strategy.state.set_plan(Plan(local=LocalMode(H)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = None
    for step in range(H):
        inner_step(model, opt, rank, step)
        if step == H - 1 and rank == 1:
            with torch.no_grad():
                model[0].bias[0] = float("nan")
        rows = strategy.after_optimizer_step(True, 1.0 + rank)
    verdict = StepJudge(Guard(), state, rank, world).judge_sync(H, rows)
    return rows, verdict.skip_update, verdict.changed, strategy.state.steps.skipped_outer


def test_a_sync_whose_mean_is_not_finite_is_flagged_in_every_row_and_the_guard_falls_back():
    from tests.distributed import run_distributed

    # the mean's NaN reached every rank: every rank's row says so, whatever its own flag
    rows = [[1.0, 1.0, 1.0], [1.0, 2.0, 1.0]]
    assert run_distributed(_skipped_sync_rows, 2) == [(rows, True, True, 1)] * 2


def test_a_local_steps_run_registers_its_nodes_ranks_with_the_controller():
    """The controller prices a two-level run's plans and counts local steps' replicas by
    the ranks of a node: a run that may take local steps reports its hook's, as a per-step
    run does (registered as 1, a 2 x 2 run's replicas counted as 4 and its per-step plans
    priced flat)."""
    from types import SimpleNamespace

    from raycomp._internal.train.local_strategy import LocalStepsStrategy

    for per_node in (1, 2, 4):
        state = SimpleNamespace(ddp=False, hook=SimpleNamespace(per_node=per_node))
        assert LocalStepsStrategy(torch.nn.Linear(2, 2), state).per_node == per_node
