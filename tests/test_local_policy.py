"""``compression.local.mode: auto`` on the controller: local steps where the link makes
per-step communication the cost of a step, with the smallest H whose sync adds at most
``target_overhead`` of the compute; per step where the link is fast; switches damped; a
guard fallback during local steps halves the largest H. Reports are simulated at the
controller's interface, as for the adaptive policy."""

from __future__ import annotations

import pytest

from raycomp.config import LOCAL_MIN_GAIN, LocalSection
from raycomp.plan import Plan
from tests.support.policy_sim import (
    FAST,
    MEDIUM,
    SLOW,
    Link,
    LocalSim,
    int4_sync,
)


def expected_interval(link: Link, largest: int, target: float = 0.1) -> int:
    """What the policy should choose, from the link alone: the smallest power of two H with
    (int4 pseudo-gradients of every compressible layer) / H <= target x compute."""
    sync = int4_sync(link)
    h = 2
    while h < largest and sync / h > target * link.compute:
        h *= 2
    return h


def test_a_slow_link_gets_local_steps_with_the_smallest_interval_that_hides_the_sync():
    sim = LocalSim({"mode": "auto", "max_sync_every": 64})
    plan = sim.run(5, SLOW)  # warm-up, then the first decision
    assert plan.local is not None and plan.default.name == "int4"
    assert plan.local.sync_every == expected_interval(SLOW, 64) == 32
    assert plan.reason.startswith("local steps: H=32, pseudo-gradients int4; per step")
    # the ceiling is a ceiling
    capped = LocalSim({"mode": "auto", "max_sync_every": 8}).run(5, SLOW)
    assert capped.local is not None and capped.local.sync_every == 8


def test_local_steps_wait_for_the_warm_up_which_sends_per_step_near_lossless_and_the_guard_keeps_it_dense():
    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, warmup="near_lossless")
    sim.run(3, SLOW)  # boundaries 4, 9, 14: the warm-up, per step (int8: the mechanism tests' ladder)
    assert [(p.local, p.default.name, {spec.name for _, spec in p.layers}) for p in sim.plans] == \
        [(None, "none", {"int8"})] * 3
    assert sim.plan.reason.startswith("warm-up: link ")
    # the first decision after it: local steps, from the figures the warm-up measured
    assert sim.run(1, SLOW).local.sync_every == 32
    # the workers in fallback during the warm-up: dense, until they recover
    guarded = LocalSim({"mode": "auto", "max_sync_every": 64}, warmup="near_lossless")
    guarded.run(1, SLOW)
    guarded.fallback = True
    plan = guarded.run(1, SLOW)
    assert plan.dense and plan.reason == "guard: workers in fallback"
    guarded.fallback = False
    assert guarded.run(1, SLOW).reason.startswith("warm-up: link ")


def test_local_steps_measure_what_an_inner_step_and_a_sync_cost_and_choose_h_again():
    # per step, backward overlaps the reduction: the compute looks 3x the real one; a sync
    # costs 3x its bytes and round on the link (codec, outer step). Predicted: H=4; measured:
    # compute 50 ms, a sync ~121 ms, so H=32 hides it within 10% of the compute
    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, sync_factor=3.0, overlap=3.0, lossy="never")
    link = MEDIUM
    first = sim.run(5, link)  # the first decision at the 4th boundary, then one under H=4 (left out)
    assert first.local is not None and first.local.sync_every == 4
    assert "as measured" not in first.reason and sim.local_details()["sync_scale"] is None
    seen = [sim.run(1, link) for _ in range(6)]
    h = [p.local.sync_every for p in seen]
    # two boundaries cover two syncs and measure: H=32 asked for, taken at the next that agrees
    assert h == [4, 4, 32, 32, 32, 32], h
    details = sim.local_details()
    assert details["sync_scale"] == pytest.approx(3.0, rel=0.03)  # the byte model prices the round a little off
    assert details["inner_compute_s"] == pytest.approx(link.compute)
    assert "(compute 50 ms, a sync 121 ms as measured: inner steps, and syncs at 3x the byte model;" in seen[-1].reason
    # the measurements survive a controller restart
    policy = sim.controller.policies["run"]
    fresh = LocalSim({"mode": "auto", "max_sync_every": 64}).controller.policies["run"]
    fresh.load_state_dict(policy.state_dict())
    assert fresh.state_dict() == policy.state_dict()


def test_a_return_to_the_same_interval_measures_it_afresh():
    # H=2 measured on SLOW (syncs 1.5x the byte model); the loss falls behind: per step, and
    # the link halves its speed meanwhile; after the calm boundaries H=2 again. The policy
    # must price a sync from boundaries under H=2 on the slower link only: the first boundary
    # back (the switch) left out, none of the samples before the per-step stretch kept
    from raycomp.controllers.policies.local import RECOVERY

    sim = LocalSim({"mode": "auto", "max_sync_every": 2, "loss_tolerance": 0.05}, sync_factor=1.5, lossy="never")
    sim.loss = 2.0
    assert sim.run(8, SLOW).local.sync_every == 2
    assert sim.local_details()["sync_scale"] == pytest.approx(1.5, rel=0.03)
    for _ in range(3):
        sim.loss *= 1.1
        plan = sim.run(1, SLOW)
    assert plan.local is None and sim.local_details()["largest_allowed"] == 1
    slower = Link(bandwidth=SLOW.bandwidth / 2)
    sim.run(RECOVERY + 1, slower)
    assert sim.run(1, slower).local.sync_every == 2
    sim.run(3, slower)
    sync = int4_sync(slower) * 1.5
    history = sim.local_details()["history"]
    assert history[-1][1] == 2 and f"(compute 50 ms, a sync {sync * 1e3:.0f} ms as measured" in history[-1][3], history[-1]


def test_the_largest_interval_grows_with_the_square_of_the_learning_rates_decay():
    # SLOW asks for H=32 by time; at the peak rate H is at most sync_every_at_peak_lr (4), at
    # 0.7x the peak 4 / 0.49 = 8.2 (8), at 0.5x 16, at 0.35x 32.7 (the time rule's 32)
    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")
    sim.lr = 0.1
    plan = sim.run(5, SLOW)
    assert plan.local is not None and plan.local.sync_every == 4
    assert plan.reason.endswith("; H=32 by time, at most 4 at a learning rate 1x its peak)"), plan.reason
    seen = []
    for lr in (0.1, 0.09, 0.07, 0.07, 0.05, 0.05, 0.035, 0.035, 0.035):
        sim.lr = lr
        seen.append(sim.run(1, SLOW).local.sync_every)
    # a larger H is taken where two boundaries agree, as any other change of H
    assert seen == [4, 4, 4, 8, 8, 16, 16, 32, 32], seen
    assert "by time" not in sim.plan.reason  # the time rule binds again
    # a rate that rises again (a warm restart) lowers the largest H at once
    sim.lr = 0.1
    plan = sim.run(1, SLOW)
    assert plan.local.sync_every == 4 and "at most 4 at a learning rate 1x its peak" in plan.reason
    # the peak is the largest rate reported so far: a warm-up that rises to it keeps H at 4
    warm = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")
    for lr in (0.01, 0.03, 0.06, 0.1, 0.1):
        warm.lr = lr
        plan = warm.run(1 if lr != 0.01 else 5, SLOW)
        assert plan.local is None or plan.local.sync_every == 4, (lr, plan.reason)
    assert plan.local is not None


def test_the_learning_rate_rule_is_off_without_a_rate_or_at_max_sync_every():
    for local, lr in (({"mode": "auto", "max_sync_every": 64}, None),
                      ({"mode": "auto", "max_sync_every": 64, "sync_every_at_peak_lr": 64}, 0.1)):
        sim = LocalSim(local, lossy="never")
        sim.lr = lr
        assert sim.run(5, SLOW).local.sync_every == 32 == expected_interval(SLOW, 64)
        assert "by time" not in sim.plan.reason
    # a rate decayed to (almost) nothing leaves the time rule alone, without overflowing
    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")
    sim.lr = 0.1
    assert sim.run(5, SLOW).local.sync_every == 4
    for lr in (1e-200, 0.0, 1e-200):
        sim.lr = lr
        sim.run(1, SLOW)
    assert sim.plan.local.sync_every == 32 and "by time" not in sim.plan.reason


def test_where_the_rate_allows_only_an_interval_no_faster_than_per_step_it_stays_per_step():
    # under Adam (local steps must be predicted twice as fast) on a 5 MB/s link: int4 per
    # step 113 ms; local steps every 4 58 ms, not fast enough; the time rule's H=8 54 ms
    # would be, but the peak rate allows 4
    link = Link(bandwidth=5e6)
    sim = LocalSim({"mode": "auto", "max_sync_every": 64, "min_gain": LOCAL_MIN_GAIN["other"]}, lossy="never")
    sim.lr = 0.1
    plan = sim.run(6, link)
    assert plan.local is None and plan.reason.startswith("per step: ")
    assert "per step 113 ms predicted, local steps 58 ms" in plan.reason
    assert plan.reason.endswith("; H=8 by time, at most 4 at a learning rate 1x its peak)"), plan.reason
    sim.lr = 0.07  # 8 allowed, and taken once two boundaries agree
    assert sim.run(1, link).local is None
    assert sim.run(1, link).local.sync_every == 8


def test_a_sync_overlapped_with_the_next_inner_step_counts_only_what_it_does_not_hide():
    # SLOW: an int4 sync ~130 ms, compute 50 ms. Waited for at once it needs H=16 to stay
    # within 25% of the compute; overlapped with one inner step (delay auto) it stalls ~80
    # ms, and H=8 does
    local = {"mode": "auto", "max_sync_every": 64, "target_overhead": 0.25}
    assert LocalSim(local, lossy="never").run(5, SLOW).local.sync_every == 16
    sim = LocalSim({**local, "delay": "auto"}, lossy="never")
    plan = sim.run(5, SLOW)
    assert plan.local is not None and plan.local.sync_every == 8
    assert "(compute 50 ms, a sync 132 ms, 82 ms of it not behind the next inner step;" in plan.reason
    # measured, a sync is what the workers waited for: the same H holds
    later = [sim.run(1, SLOW) for _ in range(4)]
    assert sim.local_details()["sync_scale"] == pytest.approx(80 / 130, rel=0.03)
    # and, once it is, H=16 too (the overlap could hide a slowdown of the inner step); nothing
    # slows it here, so the sync costs its wait alone, and H=8 is taken again
    later = later[-1:] + [sim.run(1, SLOW) for _ in range(10)]
    assert [p.local.sync_every for p in later] == [16] * 9 + [8] * 2
    assert "; trying H=16: H=8 took 60 ms a step" in later[0].reason
    assert "a sync 80 ms as measured, 0 ms of it what it adds to the inner steps it overlaps (from H=8 and 16);" \
        in later[-1].reason
    details = sim.local_details()
    assert details["inner_compute_s"] == pytest.approx(SLOW.compute, rel=0.01)
    assert details["sync_scale"] == pytest.approx(80 / 130, rel=0.03)
    # under Adam on a 5 MB/s link, local steps every 4 were predicted 58 ms, not twice as fast
    # as int4 per step (113 ms); overlapped, the 32-ms sync hides behind a 50-ms inner step
    # (the rate at its peak: H at most 4)
    adam = {"mode": "auto", "max_sync_every": 64, "min_gain": LOCAL_MIN_GAIN["other"]}
    link = Link(bandwidth=5e6)
    plans = []
    for delay in (0, "auto"):
        adam_sim = LocalSim({**adam, "delay": delay}, lossy="never")
        adam_sim.lr = 0.1
        plans.append(adam_sim.run(6, link))
    assert plans[0].local is None
    first = next(row for row in adam_sim.local_details()["history"] if row[1])
    assert first[1] == 2 and "per step 113 ms predicted, local steps 50 ms (compute 50 ms, a sync 32 ms, 0 ms of it" \
        in first[3], first
    # measured at once (the switch's own boundary aside), H=2 leaves no wait, and H=4 is tried
    assert plans[1].local.sync_every == 4 and "; trying H=4: H=2 took" in plans[1].reason


def test_an_overlapped_sync_that_slows_the_next_inner_step_is_priced_by_two_intervals():
    # MEDIUM: an int4 sync ~40 ms hides behind a 50-ms inner step, but its codec adds 40 ms
    # to that step. At H=2 the workers time no wait, only a 70-ms step, so one H says a sync
    # is free; H=4 (60 ms a step) is measured too, and the compute's fall between the two,
    # compute(H) = 50 ms + 40 ms / H, prices a sync at 40 ms: H=8 (5 ms a step, the 10% target)
    sim = LocalSim({"mode": "auto", "max_sync_every": 64, "delay": "auto"}, slowdown=0.04, lossy="never")
    seen = [sim.run(5, MEDIUM)] + [sim.run(1, MEDIUM) for _ in range(6)]
    assert [p.local.sync_every for p in seen] == [2, 4, 4, 4, 4, 8, 8], [p.reason for p in seen]
    assert seen[1].reason.endswith("; trying H=4: H=2 took 70 ms a step, and a second H tells what a sync "
                                   "slows the inner step it overlaps from the compute"), seen[1].reason
    # held while H=4 is measured, although H=2's figures alone still ask for H=2
    held = [row for row in sim.local_details()["history"] if row[3].endswith("; measuring H=4 before choosing again")]
    assert [row[1:3] for row in held] == [[4, 2], [4, 2]], held
    assert "(compute 50 ms, a sync 40 ms as measured, 40 ms of it what it adds to the inner steps it overlaps " \
           "(from H=2 and 4);" in seen[-1].reason
    details = sim.local_details()
    assert details["slowdown_s"] == pytest.approx(0.04)
    assert details["inner_compute_s"] == pytest.approx(MEDIUM.compute)
    # the fit and the probe survive a controller restart
    policy = sim.controller.policies["run"]
    fresh = LocalSim({"mode": "auto", "max_sync_every": 64, "delay": "auto"}).controller.policies["run"]
    fresh.load_state_dict(policy.state_dict())
    assert fresh.state_dict() == policy.state_dict()
    # a sync waited for at once is all in the wait: one H measures it, nothing is probed
    waited = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")
    plans = [waited.run(5, MEDIUM)] + [waited.run(1, MEDIUM) for _ in range(8)]
    assert not any("trying" in p.reason for p in plans)
    assert waited.local_details()["slowdown_s"] is None
    # nor beyond what the learning rate allows: H=2 at its peak here, H=4 once it is 0.7x
    capped = LocalSim({"mode": "auto", "max_sync_every": 64, "delay": "auto", "sync_every_at_peak_lr": 2},
                      slowdown=0.04, lossy="never")
    capped.lr = 0.1
    plans = [capped.run(5, MEDIUM)] + [capped.run(1, MEDIUM) for _ in range(8)]
    assert [p.local.sync_every for p in plans] == [2] * 9 and not any("trying" in p.reason for p in plans)
    capped.lr = 0.07
    plan = capped.run(1, MEDIUM)
    assert plan.local.sync_every == 4 and "; trying H=4: H=2 took 70 ms a step" in plan.reason


def test_the_slowdown_is_measured_once_and_a_drifting_machine_moves_only_the_compute():
    # after the pair (H=2, 4) the machine slows: every step's compute 60 ms instead of 50.
    # Under H=8 the compute is measured afresh (65 ms a step, 60 of it the inner step's), the
    # slowdown stays the pair's 40 ms: no slope is drawn between figures of different hours
    local = {"mode": "auto", "max_sync_every": 64, "delay": "auto"}
    sim = LocalSim(local, slowdown=0.04, lossy="never")
    sim.run(11, MEDIUM)  # H=2, then 4 tried and measured: the slowdown, and H=8
    assert sim.plan.local.sync_every == 8
    slower = Link(bandwidth=MEDIUM.bandwidth, compute=0.06)
    sim.run(8, slower)
    details = sim.local_details()
    assert details["slowdown_s"] == pytest.approx(0.04)
    assert details["inner_compute_s"] == pytest.approx(0.06)
    assert sum("trying" in row[3] for row in details["history"]) == 1
    assert "(compute 60 ms, a sync 40 ms as measured, 40 ms of it what it adds to the inner steps it overlaps " \
           "(from H=2 and 4);" in sim.local_details()["history"][-1][3]
    # a compute that grew between the two H (the machine, not the sync) gives no slowdown,
    # and nothing is probed again
    drifting = LocalSim(local, lossy="never")
    drifting.run(7, MEDIUM)  # H=2 measured, H=4 tried
    assert drifting.plan.local.sync_every == 4 and "trying H=4" in drifting.plan.reason
    drifting.run(8, Link(bandwidth=MEDIUM.bandwidth, compute=0.07))
    details = drifting.local_details()
    assert details["slowdown_s"] == 0.0 and details["sync_every"] == 2
    assert sum("trying" in row[3] for row in details["history"]) == 1


def test_local_steps_once_taken_stay_while_they_are_faster_at_all():
    # SLOW, H at most 2: predicted 116 ms a step against int8 per step's 309, local steps are
    # taken. Measured, a sync costs 3.7x its bytes: 290 ms a step, faster than per step but
    # not by min_gain (10%), which only entering asks for; at 5x, 374 ms, per step is faster
    # and the run goes back to it
    stays = LocalSim({"mode": "auto", "max_sync_every": 2}, sync_factor=3.7, lossy="never")
    plans = [stays.run(5, SLOW)] + [stays.run(1, SLOW) for _ in range(8)]
    assert all(p.local is not None and p.local.sync_every == 2 for p in plans), [p.reason for p in plans]
    last = stays.local_details()["history"][-1][3]
    assert "per step 309 ms predicted, local steps 290 ms" in last and "local steps must be faster to stay" in last
    leaves = LocalSim({"mode": "auto", "max_sync_every": 2}, sync_factor=5.0, lossy="never")
    plans = [leaves.run(5, SLOW)] + [leaves.run(1, SLOW) for _ in range(8)]
    assert plans[0].local is not None and plans[-1].local is None
    left = next(row for row in leaves.local_details()["history"] if row[1] == 0)
    assert "local steps 374 ms" in left[3] and "local steps must be faster to stay" in left[3], left


def test_a_looser_overhead_target_gives_a_shorter_interval():
    plan = LocalSim({"mode": "auto", "max_sync_every": 64, "target_overhead": 0.5}).run(5, SLOW)
    assert plan.local is not None
    assert plan.local.sync_every == expected_interval(SLOW, 64, target=0.5) < 32


def test_a_fast_link_stays_per_step():
    sim = LocalSim({"mode": "auto"})
    plan = sim.run(12, FAST)
    assert plan.local is None
    assert sim.local_details()["sync_every"] == 0
    assert all(h[1] == 0 for h in sim.local_details()["history"])


def test_under_adam_local_steps_must_be_predicted_twice_as_fast():
    # int4 per step (lossy rungs off, as for an Adam) on a link where local steps every 8
    # are predicted 1.7x faster: an SGD run (min_gain 0.1) takes them, an Adam run (1.0)
    # stays per step and says why; only a slower link, 2x and more, takes an Adam there
    link = Link(bandwidth=8e6)
    sgd = LocalSim({"mode": "auto"}, lossy="never").run(6, link)
    assert sgd.local is not None and sgd.local.sync_every == 8
    adam = LocalSim({"mode": "auto", "min_gain": LOCAL_MIN_GAIN["other"]}, lossy="never")
    plan = adam.run(6, link)
    assert plan.local is None and plan.spec_for("fc1.weight").name == "int8"
    assert plan.reason.startswith("per step: ") and plan.reason.endswith("local steps must be 100% faster)")
    assert "per step 90 ms predicted, local steps 53 ms" in plan.reason
    slower = LocalSim({"mode": "auto", "min_gain": LOCAL_MIN_GAIN["other"]}, lossy="never").run(6, Link(bandwidth=4e6))
    assert slower.local is not None and slower.local.sync_every == 16
    # a run registered with "auto" unresolved (not through raycomp.train) gets Adam's caution
    unresolved = LocalSim({"mode": "auto", "min_gain": "auto"}, lossy="never").run(6, link)
    assert unresolved.local is None


def test_the_worker_resolves_min_gain_from_its_optimizer():
    import torch

    from raycomp.config import CompressionSection
    from raycomp.train.options import TrainOptions, resolve_options

    params = [torch.nn.Parameter(torch.zeros(2))]
    auto = TrainOptions(compression=CompressionSection(local=LocalSection(mode="auto")))
    for optimizer, gain in ((torch.optim.SGD(params, lr=0.1, momentum=0.9), 0.1), (torch.optim.AdamW(params), 1.0),
                            (torch.optim.Adam(params), 1.0)):
        assert resolve_options(auto, optimizer).compression.local.min_gain == gain, type(optimizer).__name__
    chosen = TrainOptions(compression=CompressionSection(local=LocalSection(mode="auto", min_gain=0.3)))
    assert resolve_options(chosen, torch.optim.AdamW(params)).compression.local.min_gain == 0.3
    with pytest.raises(ValueError, match="min_gain"):
        LocalSection(min_gain="sometimes")


def test_a_switch_to_local_steps_waits_for_two_boundaries_that_agree():
    sim = LocalSim({"mode": "auto"})
    sim.run(8, FAST)
    assert sim.plan.local is None
    plans = [sim.run(1, SLOW) for _ in range(8)]
    first = next(i for i, p in enumerate(plans) if p.local is not None)
    history = sim.local_details()["history"]
    # the boundary that first wanted local steps did not switch; the next one that agreed did
    wanted = [h[2] for h in history[-8:]]
    assert first >= 1 and wanted[first - 1] > 0 and plans[first - 1].local is None
    assert all(p.local is not None for p in plans[first:])


def test_a_guard_fallback_during_local_steps_halves_the_largest_interval():
    sim = LocalSim({"mode": "auto", "max_sync_every": 64})
    assert sim.run(5, SLOW).local.sync_every == 32
    sim.fallback = True
    sim.events = [{"step": sim.step + 1, "kind": "fallback", "reason": "loss_spike", "detail": ""}]
    assert sim.run(1, SLOW).dense  # the guard's dense plan while the workers fall back
    sim.fallback, sim.events = False, []
    plan = sim.run(1, SLOW)
    assert plan.local is not None and plan.local.sync_every == 16
    assert sim.local_details()["largest_allowed"] == 16


def test_a_lowered_largest_interval_doubles_again_after_calm_boundaries():
    from raycomp.controllers.policies.local import RECOVERY

    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")  # per step: int4 throughout
    assert sim.run(5, SLOW).local.sync_every == 32
    sim.fallback = True
    sim.events = [{"step": sim.step + 1, "kind": "fallback", "reason": "loss_spike", "detail": ""}]
    sim.run(1, SLOW)
    sim.fallback, sim.events = False, []
    h = [(sim.run(1, SLOW).local.sync_every, sim.local_details()["largest_allowed"]) for _ in range(RECOVERY + 2)]
    # RECOVERY calm boundaries at H=16: the largest back to 32 at the last, which asks for
    # H=32; the next boundary agrees and takes it
    assert h == [(16, 16)] * (RECOVERY - 1) + [(16, 32), (32, 32), (32, 32)], h
    recover = [row for row in sim.local_details()["history"] if row[2] == "recover"]
    assert recover == [[recover[0][0], 16, "recover", f"largest H back to 32 after {RECOVERY} boundaries without a "
                                                      "step back"]]
    # a fallback among the calm boundaries starts the count again
    sim.fallback, sim.events = True, [{"step": sim.step + 1, "kind": "fallback", "reason": "loss_spike", "detail": ""}]
    sim.run(1, SLOW)
    sim.fallback, sim.events = False, []
    sim.run(RECOVERY - 2, SLOW)
    sim.fallback = True  # the guard falls back again (its event already counted): no step back, no calm
    sim.run(1, SLOW)
    sim.fallback = False
    sim.run(2, SLOW)
    assert sim.local_details()["largest_allowed"] == 16


def test_a_loss_that_falls_behind_under_local_steps_halves_the_interval_down_to_per_step():
    # lossy "never": the per-step plan stays int4, so only the loss moves the choice
    sim = LocalSim({"mode": "auto", "max_sync_every": 64, "loss_tolerance": 0.05}, lossy="never")
    sim.loss = 2.0
    assert sim.run(5, SLOW).local.sync_every == 32
    for loss in (1.9, 1.8, 1.8, 1.85, 1.88):  # progress, then noise within 5% of the best (1.8)
        sim.loss = loss
        assert sim.run(1, SLOW).local.sync_every == 32
    sim.loss = 1.95  # boundary means 1.915, then 1.95: above 1.8 + 5% (1.89) once, then twice
    assert sim.run(1, SLOW).local.sync_every == 32
    assert sim.run(1, SLOW).local.sync_every == 16  # at once, no waiting for agreement
    step_back = sim.local_details()["history"][-2]
    assert step_back[1:3] == [32, 16] and step_back[3].startswith("step back: loss 1.95 above 1.89")
    assert sim.local_details()["largest_allowed"] == 16
    # each H keeps its own record: a loss that keeps drifting halves it again, down to per step
    for h in (8, 4, 2, None):
        for _ in range(3):
            sim.loss *= 1.1
            plan = sim.run(1, SLOW)
        assert (plan.local.sync_every if plan.local else None) == h, sim.local_details()["history"][-3:]
    assert sim.local_details()["largest_allowed"] == 1


def test_a_falling_loss_keeps_the_interval():
    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")
    sim.loss = 2.0
    sim.run(5, SLOW)
    for i in range(20):
        sim.loss = 2.0 / (1 + 0.1 * i) * (1.02 if i % 2 else 1.0)  # falling, with noise under 5%
        assert sim.run(1, SLOW).local.sync_every == 32
    assert sim.local_details()["largest_allowed"] == 64


def test_the_default_tolerance_rides_out_a_bump_of_ten_percent():
    # dense's own curve on the CNN rises ~10% for a few boundaries near step 150 (the data
    # order); a default that halved H there would cost a harmless run its local steps
    sim = LocalSim({"mode": "auto", "max_sync_every": 64}, lossy="never")
    sim.loss = 1.0
    assert sim.run(5, SLOW).local.sync_every == 32
    for loss in (0.5, 0.5, 0.555, 0.555, 0.555, 0.5):  # the lowest 0.5, then 11% above it
        sim.loss = loss
        assert sim.run(1, SLOW).local.sync_every == 32
    sim.loss = 0.6  # 20% above: the two-boundary mean 0.5775, then 0.6, above 0.575 twice
    assert [sim.run(1, SLOW).local.sync_every for _ in range(3)] == [32, 32, 16]


@pytest.mark.parametrize("compressor", ["int8", "sparseloco"])  # sparseloco: the SparseLoCo recipe in one key
def test_fixed_mode_is_local_steps_from_the_first_decision_with_the_configured_compressor(compressor):
    sim = LocalSim({"mode": "fixed", "sync_every": 8, "fragments": 2, "compressor": compressor})
    sim.run(3, FAST)
    assert sim.plan.local is None  # the warm-up: dense, per step
    plan = sim.run(1, FAST)
    assert plan.local is not None and (plan.local.sync_every, plan.local.fragments) == (8, 2)
    assert plan.default.name == compressor


def test_the_policy_state_survives_a_controller_restart():
    sim = LocalSim({"mode": "auto", "max_sync_every": 64})
    sim.run(5, SLOW)
    policy = sim.controller.policies["run"]
    saved = policy.state_dict()
    fresh = LocalSim({"mode": "auto", "max_sync_every": 64}).controller.policies["run"]
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved


@pytest.mark.parametrize(("local", "message"), [
    ({"mode": "auto", "fragments": 3, "sync_every": 8}, "fragments: must divide sync_every"),
    ({"mode": "fixed", "sync_every": 8, "delay": 8}, "delay: must be below sync_every / fragments"),
    ({"mode": "fixed", "nesterov": True}, "nesterov: needs outer_momentum > 0"),
    ({"mode": "fixed", "delay": "soon"}, "delay\n.*must be 'auto' or an integer >= 0, got 'soon'"),
    ({"mode": "fixed", "delay": -1}, "delay\n.*must be 'auto' or an integer >= 0, got -1"),
])
def test_bad_local_options_are_refused_naming_the_key(local, message):
    from raycomp.config import CompressionSection

    with pytest.raises(ValueError, match=message):
        CompressionSection.model_validate({"local": local})


@pytest.mark.parametrize(("world", "per_node", "at_peak", "note"), [
    (2, 1, 4.0, ""), (4, 2, 4.0, ""),  # two replicas: flat, or two nodes of two
    (4, 1, 4 * 2 / 3, " and 4 replicas"), (8, 2, 4 * 2 / 3, " and 4 replicas"), (8, 1, 4 * 4 / 7, " and 8 replicas")])
def test_the_learning_rates_cap_is_set_for_two_replicas_and_lower_for_more(world, per_node, at_peak, note):
    """R replicas drift from their mean as (1 - 1/R) x H between syncs: the cap keeps the
    two-replica distance (a node is one replica where a run steps in two levels)."""
    from raycomp.controllers.policies import make_policy
    from raycomp.controllers.policies.local import LocalChoice
    from raycomp.controllers.policies.local_why import LocalWhy
    from raycomp.controllers.state import RunState

    policy = LocalChoice(make_policy("adaptive", {"min_compress_numel": 1024}),
                         LocalSection(mode="auto", max_sync_every=64))
    run = RunState("r", world, {"v": [4096]}, "adaptive", {})
    run.per_node, run.lr, run.peak_lr = per_node, 0.05, 0.1
    assert policy._lr_allows(run) == pytest.approx(at_peak * 4)  # at half the peak: 4x
    run.lr = 0.1
    # a sync too slow for any H: the largest the rate allows, a power of two
    assert policy._interval(1e9, 1.0, policy._lr_allows(run)) == (4 if at_peak == 4 else 2)
    why = LocalWhy(rule="local.steps", h=2, pseudo="int4", per_step_reason="", per_step=0.2, local_step=0.1,
                   compute=0.1, sync=0.0, stall=0.0, candidate=2, by_time=8, lr_fraction=1.0, min_gain=0.1,
                   staying=True, sync_scale=None, slowdown=None, slowdown_from=(), probe_taken=None,
                   replicas=world // per_node)
    assert why.text().endswith(f"at most 2 at a learning rate 1x its peak{note})")


@pytest.mark.parametrize(("node_link", "local"), [(None, True), (1.5e-8, False)])
def test_a_node_replicas_inner_step_is_priced_with_its_all_reduce_inside_the_node(node_link, local):
    """Two nodes of two: every inner step of local steps all-reduces the gradient inside the
    node. On a link as fast inside a node as across (the timed node link near the measured
    one), that all-reduce costs what the flat one did, so local steps gain nothing; priced
    without it (untimed) they look 17% faster and are taken."""
    from raycomp.controllers.policies import make_policy
    from raycomp.controllers.policies.local import LocalChoice
    from raycomp.controllers.state import RunState
    from raycomp.plan import CompressorSpec

    policy = LocalChoice(make_policy("adaptive", {"min_compress_numel": 1024}),
                         LocalSection(mode="auto", min_gain=0.1, delay=0))
    run = RunState("r", 4, {"w": [1024, 1024]}, "adaptive", {})
    run.per_node, run.node_link = 2, node_link
    policy.cost.state.bw, policy.cost.state.compute = 1e8, 0.3  # a dense step: 0.3 s + 63 ms on the link
    policy.state.last = Plan(reason="dense")
    decision = policy._auto(run, CompressorSpec.of("int4"))
    why = decision.why
    inside = 0.0 if node_link is None else 4 * 1024 * 1024 * node_link
    assert why.inside == pytest.approx(inside)
    assert why.compute == pytest.approx(0.3 + inside)
    assert (decision.plan.local is not None) is local
    if local:
        assert "inside the node" not in decision.plan.reason
    else:
        assert f"compute {(0.3 + inside) * 1e3:.0f} ms with {inside * 1e3:.0f} ms inside the node" in decision.plan.reason


@pytest.mark.parametrize(("world", "per_node"), [(2, 1), (4, 2)], ids=["flat", "node-replicas"])
def test_a_sync_kept_on_the_wire_stalls_only_what_its_delays_inner_steps_do_not_hide(world, per_node):
    """A sync kept on the wire for ``delay`` inner steps stalls only what they do not hide,
    flat or a node replica's (whose cross-node hop stays in flight the same way)."""
    from raycomp.controllers.policies import make_policy
    from raycomp.controllers.policies.local import LocalChoice
    from raycomp.controllers.policies.local_why import LocalWhy
    from raycomp.controllers.state import RunState

    policy = LocalChoice(make_policy("adaptive", {"min_compress_numel": 1024}),
                         LocalSection(mode="auto", min_gain=0.1, delay=1))
    run = RunState("r", world, {"w": [1024, 1024]}, "adaptive", {})
    run.per_node = per_node
    policy.cost.state.bw, policy.cost.state.compute = 1e7, 0.3  # a slow link: int4's sync ~0.1 s
    decision = policy.decide(run)
    assert decision is not None and isinstance(decision.why, LocalWhy)
    why = decision.why
    assert why.sync > 0.05
    assert why.stall == pytest.approx(max(0.0, why.sync - 0.3))
