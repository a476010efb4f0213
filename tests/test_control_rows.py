"""The control rows' layouts on the wire, and what :class:`StepJudge` reads of them on one
process (no reduction carries them: its fallback exchange builds the rows)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from raycomp._internal.guard import Guard
from raycomp._internal.train.plan_handoff import PlanHandoff
from raycomp._internal.train.reporter import Outages
from raycomp._internal.train.step_judge import StepJudge
from raycomp._internal.wire.control_rows import GuardRow, SyncRow
from raycomp.plan import Plan


def test_each_layout_keeps_its_floats_in_order_and_reads_them_back():
    # the reducer writes the flag first, and a checkpoint keeps the staged floats: the order is fixed
    assert GuardRow().to_row() == [0.0, 0.0, 0.0, -1.0, 0.0]
    row = GuardRow(nonfinite=True, loss=2.5, worst_error=0.25, plan_offer=3)
    assert row.to_row() == [1.0, 2.5, 1.0, 0.25, 3.0] and row.staged() == [2.5, 1.0, 0.25, 3.0]
    assert GuardRow.from_row(row.to_row()) == row and GuardRow.from_staged(row.staged()) == GuardRow(
        loss=2.5, worst_error=0.25, plan_offer=3)
    assert SyncRow().to_row() == [0.0, 0.0, 0.0] and SyncRow(mean_loss=1.5).staged() == [1.5, 1.0]
    assert SyncRow.from_row([1.0, 1.5, 1.0]) == SyncRow(nonfinite=True, mean_loss=1.5)
    assert len(GuardRow().to_row()) == GuardRow.WIDTH and len(SyncRow().to_row()) == SyncRow.WIDTH
    with pytest.raises(ValueError, match="^SyncRow: a row of 3 floats expected, got 4$"):
        SyncRow.from_row([0.0, 1.0, 1.0, 0.0])


class _OneRank:
    """What StepJudge reads of a rank's state, on one process, without a reduction."""

    def __init__(self) -> None:
        self.control_rows: torch.Tensor | None = None
        self.staged: list[list[float]] = []
        self.skippable: list[bool] = []
        self.norm = 1.0
        self.stats, self.stats_step, self.step = [], -1, 0
        self.plan = Plan.uniform("int8")  # a compressed plan: the guard's rules apply

    control_skipped = False
    measures_mean_error = False  # each rank's own error rides in the rows

    def stage_control(self, values, skippable: bool = False) -> None:
        self.staged.append(list(values))
        self.skippable.append(skippable)

    def gradient_norm(self, parameters) -> float:
        return self.norm


def _handoff(state, guard: Guard) -> PlanHandoff:
    """One rank's plan hand-off without a controller, dense values left out at boundaries."""
    control = SimpleNamespace(interval_steps=10, first_interval_steps=10, dense_control="at_boundaries")
    return PlanHandoff(0, 1, None, None, "run", Outages(), state=state, guard=guard, plan_log=None,
                       options=SimpleNamespace(controller=control))


def test_the_guard_reads_the_offer_and_leaves_a_skipped_step_s_loss_unjudged():
    state = _OneRank()
    guard = StepJudge(Guard(), state, rank=0, world_size=1)
    assert state.staged == [[0.0, 0.0, -1.0, 0.0]]  # nothing to judge yet
    guard.stage(math.nan, applied=False, offer=7)  # a skipped step: its NaN loss rides without its flag
    assert not guard.decide(1, []).skip_update and guard.announced == 7
    guard.stage(math.nan, applied=True)
    assert guard.decide(2, []).skip_update


def test_a_checkpoint_from_before_the_plan_offer_stages_none():
    state = _OneRank()
    guard = StepJudge(Guard(), state, rank=0, world_size=1)
    guard.load_state_dict({"guard": Guard().state_dict(), "carry": [1.5, 1.0, 0.25], "inner_norms": []})
    assert state.staged[-1] == [1.5, 1.0, 0.25, 0.0] and guard.state_dict()["carry"] == [1.5, 1.0, 0.25, 0.0]


def test_at_boundaries_a_dense_step_may_go_without_the_values_until_the_guard_falls_back():
    state = _OneRank()
    judge = StepJudge(Guard(), state, rank=0, world_size=1, every_step=False)
    assert state.skippable == [False]  # the first step's values: not yet judged skippable
    judge.stage(2.0, applied=True, offer=5)
    assert state.skippable[-1] and state.staged[-1] == [2.0, 1.0, -1.0, 5.0]
    state.control_skipped = True  # DDP's own step went without them: nothing read, nothing announced
    assert not judge.decide(1, []).skip_update and judge.announced == 0
    state.norm = math.nan  # a non-finite mean is caught all the same, and the guard falls back
    assert judge.decide(2, []).skip_update and judge.guard.active
    judge.stage(2.0, applied=False)
    assert state.skippable[-1] is False  # in fallback every step carries them: recovery reads losses
    every = StepJudge(Guard(), _OneRank(), rank=0, world_size=1)
    every.stage(2.0, applied=True)
    assert every.state.skippable == [False, False]


def test_at_boundaries_a_loss_left_out_waits_for_the_agreement_and_is_judged_there():
    state = _OneRank()
    judge = StepJudge(Guard(loss_window=4), state, rank=0, world_size=1, every_step=False)
    handoff = _handoff(state, judge.guard)
    state.control_skipped = True
    for step, loss in enumerate((2.0, 2.1, 1.9, 2.0, 2.2, 2.05), start=1):
        judge.stage(loss, applied=True)
        judge.decide(step, [])
        handoff.hear(judge.announced, judge.left_out)
    judge.stage(7.0, applied=False)  # a skipped step's loss is never judged, late or not
    judge.decide(7, [])
    assert judge.left_out is None
    handoff.hear(judge.announced, judge.left_out)
    # the last window's worth waits, oldest first, for the next agreement; none was judged
    assert list(handoff.late) == [1.9, 2.0, 2.2, 2.05] and not judge.guard.losses
    saved = handoff.state_dict()
    assert saved["late"] == [1.9, 2.0, 2.2, 2.05]
    restored = _handoff(_OneRank(), Guard(loss_window=4))
    restored.load_state_dict(saved)
    # the agreement carries them once (one rank: their means are theirs)
    assert restored.agree(8, 0, (), 0.0).late == [1.9, 2.0, 2.2, 2.05] and restored.agree(9, 0, (), 0.0).late == []
    # the agreement hands back the ranks' means: they fill the guard's window; under the
    # dense plan they ran with nothing falls back, however they rise (plain DDP's training)
    state.plan = Plan()
    for loss in (2.0, 2.1, 1.9, 2.0):
        assert not judge.judge_late(9, loss).changed
    assert list(judge.guard.losses) == [2.0, 2.1, 1.9, 2.0]
    assert not any(judge.judge_late(9, 40.0).changed for _ in range(5)) and not judge.guard.active
    for loss in (2.0, 2.1, 1.9, 2.0):
        judge.judge_late(9, loss)
    # under a compressed plan a sustained spike among them falls back
    state.plan = Plan.uniform("int8")
    verdicts = [judge.judge_late(9, loss) for loss in (40.0,) * 5]
    assert any(v.changed for v in verdicts) and judge.guard.active
    assert judge.guard.events[-1].reason == "loss_spike" and judge.guard.events[-1].step == 9
    assert not any(v.skip_update for v in verdicts)  # the steps were applied long ago: nothing to skip


def test_a_dense_plan_skips_a_nonfinite_step_without_falling_back_and_a_compressed_one_falls_back():
    state = _OneRank()
    state.plan = Plan()  # the controller's dense plan: the run trains as plain DDP
    judge = StepJudge(Guard(), state, rank=0, world_size=1)
    for step in range(5):
        judge.stage(2.0, applied=True)
        assert not judge.decide(step, []).skip_update
    state.norm = 1000.0  # no explosion under a dense plan
    assert not judge.decide(5, []).skip_update
    state.norm = math.nan
    verdict = judge.decide(6, [])
    assert verdict.skip_update and not verdict.changed and not judge.guard.active and not judge.guard.events
    state.plan = Plan.uniform("int4")
    verdict = judge.decide(7, [])
    assert verdict.skip_update and verdict.changed and judge.guard.reason == "nonfinite_gradient"
    state.plan, state.norm = Plan(dense=True), 1.0  # the guard's own dense override: its rules still judge
    assert judge.compressing
