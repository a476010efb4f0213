"""The worker guard's state machine: triggers, skip decisions, hysteresis, state."""

from __future__ import annotations

from raycomp._internal.guard import Guard


def feed(guard: Guard, steps: range, loss: float = 1.0, norm: float = 1.0):
    return [guard.observe(s, False, loss, None, norm) for s in steps]


def test_each_trigger_falls_back_with_its_reason():
    cases = {
        "nonfinite_gradient": dict(nonfinite=True, loss=1.0, max_error=None, grad_norm=1.0),
        "gradient_explosion": dict(nonfinite=False, loss=1.0, max_error=None, grad_norm=50.0),
        "loss_spike": dict(nonfinite=False, loss=100.0, max_error=None, grad_norm=1.0),
        "compression_error": dict(nonfinite=False, loss=1.0, max_error=2.5, grad_norm=1.0),
    }
    for reason, kwargs in cases.items():
        guard = Guard(stable_steps=3)
        feed(guard, range(5))
        verdict = guard.observe(5, **kwargs)
        assert guard.active and guard.reason == reason and verdict.changed
        assert verdict.skip_update == (reason in ("nonfinite_gradient", "gradient_explosion"))
        assert guard.events[-1].step == 5 and guard.events[-1].kind == "fallback"


def test_nan_loss_counts_as_nonfinite():
    guard = Guard()
    assert guard.observe(0, False, float("nan"), None).skip_update


def test_hysteresis_recovers_after_stable_steps_and_retrigger_resets_it():
    guard = Guard(stable_steps=3)
    feed(guard, range(5))
    guard.observe(5, True, 1.0, None)
    assert [v.changed for v in feed(guard, range(6, 8))] == [False, False]
    guard.observe(8, True, 1.0, None)  # again: the clean count starts over
    verdicts = feed(guard, range(9, 12))
    assert [v.changed for v in verdicts] == [False, False, True]
    assert not guard.active
    assert [(e.step, e.kind) for e in guard.events] == [(5, "fallback"), (11, "recovered")]


def test_spikes_do_not_enter_the_windows_and_state_round_trips():
    guard = Guard(stable_steps=2)
    feed(guard, range(10), loss=2.0, norm=3.0)
    guard.observe(10, False, 100.0, None, 3.0)
    assert max(guard.losses) == 2.0
    copy = Guard(stable_steps=2)
    copy.load_state_dict(guard.state_dict())
    assert copy.state_dict() == guard.state_dict()
    assert copy.observe(11, False, 2.0, None, 3.0) == guard.observe(11, False, 2.0, None, 3.0)


def test_disabled_guard_still_skips_nonfinite_steps():
    guard = Guard(enabled=False)
    assert guard.observe(0, True, 1.0, None).skip_update
    assert not guard.active and not guard.events


def test_noise_of_a_small_late_loss_is_not_a_spike():
    # the loss values that tripped the guard late in a real run: median ~0.025, batch noise
    guard = Guard(stable_steps=5)
    noisy = [0.02, 0.03, 0.01, 0.05, 0.025, 0.04, 0.015, 0.06, 0.02, 0.035, 0.03, 0.02]
    for step, loss in enumerate(noisy):
        guard.observe(step, False, loss, None, 1.0)
    assert not guard.observe(12, False, 0.109, None, 1.0).changed
    assert not guard.active
    # a sustained rise is a spike within a few steps
    verdicts = [guard.observe(13 + i, False, 1.0, None, 1.0) for i in range(3)]
    assert any(v.changed for v in verdicts) and guard.reason == "loss_spike"


def test_an_inner_step_is_judged_on_its_own_norms_and_a_bad_one_never_enters_them():
    import math

    import torch

    from raycomp._internal.train.step_judge import StepJudge

    class OneRank:  # during local steps the norm is this rank's own gradient's
        norm = 1.0

        control_skipped = False

        def stage_control(self, values, skippable: bool = False) -> None:
            pass

        def gradient_norm(self, parameters) -> float:
            return self.norm

    state = OneRank()
    guard = StepJudge(Guard(grad_norm_factor=10.0), state, rank=0, world_size=1)
    params = [torch.zeros(1)]
    assert all(guard.judge_inner(params) for _ in range(3))
    for bad in (math.nan, math.inf, 50.0):  # non-finite, or above 10 x the recent level: skipped here
        state.norm = bad
        assert not guard.judge_inner(params)
    assert list(guard.inner_norms) == [1.0, 1.0, 1.0]
    state.norm = 5.0
    assert guard.judge_inner(params) and list(guard.inner_norms)[-1] == 5.0


def test_under_a_dense_plan_no_rule_falls_back_and_only_a_nonfinite_gradient_is_skipped():
    guard = Guard(stable_steps=3)
    for step in range(5):
        guard.observe(step, False, 1.0, None, 1.0, compressing=False)
    quiet = [guard.observe(5, False, 1.0, None, 50.0, compressing=False),  # an exploding norm
             *(guard.observe(6 + i, False, 100.0, None, 1.0, compressing=False) for i in range(5)),  # a spike
             guard.observe(11, False, 1.0, 5.0, 1.0, compressing=False)]  # a compression error, measured
    assert not any(v.skip_update or v.changed for v in quiet) and not guard.events
    skipped = guard.observe(12, True, 1.0, None, 1.0, compressing=False)
    assert skipped.skip_update and not skipped.changed and not guard.active and not guard.events
    # the dense steps filled the windows: the first compressed step is judged against them
    assert len(guard.grad_norms) == 12 and guard.peak_norm_level == 50.0
    assert guard.observe(13, False, 1.0, 2.5, 1.0).changed and guard.reason == "compression_error"


def test_a_tenfold_norm_at_tiny_late_norms_is_not_an_explosion_but_one_above_the_run_s_level_is():
    guard = Guard(stable_steps=3)
    for step in range(20):  # early training: norms near 1
        guard.observe(step, False, 1.0, None, 1.0 + 0.01 * step)
    for step in range(20, 60):  # late: a hundredth of them
        guard.observe(step, False, 1e-4, None, 0.015)
    noisy = guard.observe(60, False, 1e-4, None, 0.159)  # the quick start's false alarm
    assert not noisy.skip_update and not guard.active
    exploded = guard.observe(61, False, 1e-4, None, 2.0)
    assert exploded.skip_update and guard.reason == "gradient_explosion"
    assert "highest level 1.18" in guard.events[-1].detail


def test_an_error_measured_apart_falls_back_above_the_threshold_and_is_no_clean_step():
    guard = Guard(stable_steps=3)
    feed(guard, range(5))
    assert not guard.observe_error(5, 1.9).changed and not guard.active  # under 2: nothing
    assert guard.observe_error(6, 2.5).changed and guard.reason == "compression_error"
    assert guard.events[-1].detail == "relative error 2.5 > 2.0"
    feed(guard, range(7, 9))
    assert not guard.observe_error(9, 0.1).changed and guard.clean_steps == 2  # not a step
    assert [v.changed for v in feed(guard, range(10, 11))] == [True] and not guard.active
