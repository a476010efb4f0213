"""Local steps (raycomp._internal.local) on real gloo processes: the outer step, the averaged
pseudo-gradient, the fragment schedule, overlap, buffers, compression on the wire, resume."""

from __future__ import annotations

import copy

import pytest
import torch

from raycomp import Plan
from raycomp._internal.local import FragmentSchedule, LocalSteps, resolve_delay, split_fragments
from tests.distributed import run_distributed
from tests.support.local_model import inner_step, small_model
from tests.support.ranks import flat, gather
from tests.support.wire import WireRecorder

H = 4


# --- the schedule (pure) --------------------------------------------------------------------
def test_each_fragment_syncs_once_every_h_steps_staggered():
    s = FragmentSchedule(sync_every=8, fragments=4)
    starts = {f: [step for step in range(1, 33) if f in s.due(step)] for f in range(4)}
    assert starts == {0: [2, 10, 18, 26], 1: [4, 12, 20, 28], 2: [6, 14, 22, 30], 3: [8, 16, 24, 32]}
    assert [step for step in range(1, 17) if FragmentSchedule(4).due(step)] == [4, 8, 12, 16]


def test_fragments_are_consecutive_balanced_and_never_empty():
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split_fragments([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]


@pytest.mark.parametrize("args, message", [
    ((0,), "sync_every: must be an integer >= 1, got 0"),
    ((4, 5), "fragments: must be an integer from 1 to sync_every (4), got 5"),
    ((8, 2, 4), "delay: must be an integer from 0 to sync_every // fragments - 1 (3), got 4"),
])
def test_bad_schedules_are_refused_in_one_line(args, message):
    with pytest.raises(ValueError) as error:
        FragmentSchedule(*args)
    assert str(error.value) == message


def test_the_delay_resolves_to_one_step_where_the_syncs_are_two_or_more_apart():
    assert [resolve_delay("auto", h) for h in (1, 2, 4, 32)] == [0, 1, 1, 1]
    assert resolve_delay("auto", 8, fragments=8) == 0 and resolve_delay("auto", 8, fragments=4) == 1
    # a number is kept where the spacing allows it and capped below a smaller H's spacing
    assert [resolve_delay(3, h) for h in (1, 2, 4, 8)] == [0, 1, 3, 3]
    assert resolve_delay(0, 16) == 0


# --- on gloo ------------------------------------------------------------------------------
def _averaging_run(rank, world, outer_lr, momentum):
    model = small_model(seed=rank)  # different starts: the constructor must broadcast rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def outer(params):
        return torch.optim.SGD(params, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)

    local = LocalSteps(model, sync_every=H, outer_optimizer=outer)
    start = flat(model.parameters()).clone()
    starts_equal = all(torch.equal(t, start) for t in gather(start))
    global_w, buf, syncs = start.clone(), torch.zeros_like(start), []
    for step in range(1, 3 * H + 1):
        inner_step(model, opt, rank, step)
        if step % H == 0:
            pseudo = torch.stack(gather(global_w - flat(model.parameters()))).mean(0)  # independent mean
            buf = momentum * buf + pseudo
            global_w = global_w - outer_lr * (pseudo + momentum * buf if momentum else pseudo)
        synced = local.step()
        syncs.append(synced)
        if step % H == 0:
            assert synced
            assert torch.allclose(flat(model.parameters()), global_w, atol=1e-6), (step, (flat(model.parameters()) - global_w).abs().max())
    return starts_equal, syncs, flat(model.parameters()), local.outer_steps


@pytest.mark.parametrize("outer_lr, momentum", [(1.0, 0.0), (0.7, 0.9)], ids=["averaging", "nesterov"])
def test_the_outer_step_applies_the_mean_pseudo_gradient_on_every_rank(outer_lr, momentum):
    results = run_distributed(_averaging_run, 2, outer_lr, momentum)
    for starts_equal, syncs, _, outer_steps in results:
        assert starts_equal
        assert syncs == [s % H == 0 for s in range(1, 3 * H + 1)]
        assert outer_steps == 3
    assert torch.equal(results[0][2], results[1][2])  # bit-identical weights after the last sync


def _fragments_run(rank, world):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSteps(model, sync_every=H, fragments=2, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    members = local.fragment_members
    seen = []
    for step in range(1, 2 * H + 1):
        inner_step(model, opt, rank, step)
        local.step()
        same = [all(torch.equal(t, local.params[i].detach()) for t in gather(local.params[i].detach()))
                for i in range(len(local.params))]
        seen.append((step, [all(same[i] for i in m) for m in members], [any(same[i] for i in m) for m in members]))
    return members, seen


def test_fragments_sync_in_turn_and_only_their_own_parameters():
    for members, seen in run_distributed(_fragments_run, 2):
        assert len(members) == 2 and all(members)
        for step, all_same, any_same in seen:
            due = FragmentSchedule(H, 2).due(step)
            for f in range(2):
                if f in due:
                    assert all_same[f], (step, f)  # just synced: equal on both ranks
                elif step % (H // 2) == 0:
                    assert not any_same[f], (step, f)  # the other fragment has drifted apart


def _delay_run(rank, world):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSteps(model, sync_every=H, delay=1, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    global_w = flat(model.parameters()).clone()
    for step in range(1, 2 * H + 2):
        inner_step(model, opt, rank, step)
        if step % H == 0:
            mean_local = torch.stack(gather(flat(model.parameters()))).mean(0)
            at_start = flat(model.parameters()).clone()
        if step % H == 1 and step > 1:  # the sync started one step ago lands now
            global_w = mean_local
            expected = global_w + (flat(model.parameters()) - at_start)
        applied = local.step()
        assert local.quiescent == (step % H != 0)
        if step % H == 1 and step > 1:
            assert applied
            assert torch.allclose(flat(model.parameters()), expected, atol=1e-6), step
    return True


def test_an_overlapped_sync_keeps_the_inner_steps_that_ran_meanwhile():
    assert run_distributed(_delay_run, 2) == [True, True]


def _merge_run(rank, world):
    """Nesterov outer steps (momentum 0.9), H=4 with a sync kept on the wire: H + 2 inner
    steps, then ``merge_all`` twice, then once more after a checkpoint round trip."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSteps(model, sync_every=H, delay=1)  # nesterov_outer: lr 0.7, momentum 0.9
    for step in range(1, H + 3):
        inner_step(model, opt, rank, step)
        local.step()
    before = flat(model.parameters()).clone()
    apart = not torch.equal(*gather(before))
    # the sync on the wire lands (its outer step), then every fragment syncs once more
    first = local.merge_all()
    merged, wire = flat(model.parameters()).clone(), local.reducer.ledger.wire_total
    again = local.merge_all()  # nothing ran since: no sync, no outer step on its momentum
    unchanged = torch.equal(flat(model.parameters()), merged) and local.reducer.ledger.wire_total == wire
    saved = copy.deepcopy(local.state_dict())
    restored = LocalSteps(model, sync_every=H, delay=1)
    restored.load_state_dict(saved)
    after_resume = restored.merge_all()
    return (apart, first, local.outer_steps, torch.equal(*gather(merged)), again, unchanged, after_resume,
            torch.equal(flat(model.parameters()), merged))


def _merge_after_sync_run(rank, world, fragments):
    """``merge_all`` right after the schedule's sync at step H (waited for at once), then
    after one more inner step: the outer steps applied, and whether bytes were sent."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSteps(model, sync_every=H, fragments=fragments)  # nesterov_outer
    seen = []
    for step in range(1, H + 2):
        inner_step(model, opt, rank, step)
        local.step()
        if step >= H:
            wire = local.reducer.ledger.wire_total
            seen.append((local.merge_all(), local.reducer.ledger.wire_total > wire))
    return seen


def test_merging_at_the_end_leaves_every_rank_with_the_same_weights_once():
    # the sync on the wire (1 outer step) and the merge's own (1): the ranks equal after it;
    # a second merge, and one after a resume from a checkpoint taken then, does nothing
    expected = (True, 1, 2, True, 0, True, 0, True)
    assert run_distributed(_merge_run, 2) == [expected, expected]
    # right after a sync of the whole model nothing is sent; after one more inner step, or
    # where the last sync covered one fragment of two, every fragment is synced
    assert run_distributed(_merge_after_sync_run, 2, 1) == [[(0, False), (1, True)]] * 2
    assert run_distributed(_merge_after_sync_run, 2, 2) == [[(2, True), (2, True)]] * 2


def _buffers_run(rank, world, mode):
    model = small_model(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSteps(model, sync_every=H, buffers=mode)
    for step in range(1, H + 1):
        inner_step(model, opt, rank, step)
        local.step()
    bn = model[1]
    return [torch.equal(t, bn.running_mean) for t in gather(bn.running_mean)]


@pytest.mark.parametrize("mode, equal", [("average", True), ("local", False)])
def test_batchnorm_statistics_are_averaged_at_the_sync_or_kept_local(mode, equal):
    for flags in run_distributed(_buffers_run, 2, mode):
        assert all(flags) == equal


def _wire_run(rank, world, plan_name):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = Plan.uniform(plan_name) if plan_name else None
    local = LocalSteps(model, sync_every=H, plan=plan, min_compress_numel=256, buffers="local")
    with WireRecorder() as recorder:
        for step in range(1, 2 * H + 1):
            inner_step(model, opt, rank, step)
            local.step()
    return recorder.transmitted, local.reducer.ledger.wire_total, local.reducer.ledger.dense_total


def test_int8_pseudo_gradients_shrink_the_bytes_at_torch_distributed():
    dense_wire, dense_ledger, _ = run_distributed(_wire_run, 2, None)[0]
    int8_wire, int8_ledger, int8_dense = run_distributed(_wire_run, 2, "int8")[0]
    assert dense_wire == pytest.approx(dense_ledger)  # the ledger counts what torch.distributed sent
    assert int8_wire == pytest.approx(int8_ledger)
    assert int8_dense == pytest.approx(dense_wire)
    assert int8_wire < 0.4 * dense_wire  # 1 byte a value against 4, plus scales and small layers


def _resume_run(rank, world, stop_at):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    plan = Plan.uniform("topk", ratio=0.1)
    make = lambda m: LocalSteps(m, sync_every=H, plan=plan, min_compress_numel=64)  # noqa: E731
    local = make(model)
    saved = None
    for step in range(1, 3 * H + 1):
        inner_step(model, opt, rank, step)
        local.step()
        if step == stop_at:
            saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "local": local.state_dict()})
    uninterrupted = flat(model.parameters())
    # a fresh process state: a different model, rebuilt and loaded from the checkpoint
    model = small_model(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.load_state_dict(saved["model"])
    local = make(model)  # broadcasts rank 0's weights: equal on every rank anyway
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    local.load_state_dict(saved["local"])
    for step in range(stop_at + 1, 3 * H + 1):
        inner_step(model, opt, rank, step)
        local.step()
    return torch.equal(flat(model.parameters()), uninterrupted)


@pytest.mark.parametrize("stop_at", [H, H + 2], ids=["at-a-sync", "mid-interval"])
def test_resume_is_bit_exact_with_the_outer_momentum_and_residuals(stop_at):
    assert run_distributed(_resume_run, 2, stop_at) == [True, True]


def _feedback(local: LocalSteps) -> dict[str, list[str]]:
    """What the reducer keeps across syncs: the layers with an error-feedback residual, and
    per stateful transport the keys of its state."""
    return {"residuals": sorted(local.reducer.memory.state_dict().get("residuals", {})),
            **{c.state_key: sorted(c.state_dict()) for c in local.reducer.communicators.values() if c.state_key}}


def _skipped_sync_run(rank, world):
    """Top-k pseudo-gradients with error feedback, H=4, three syncs; before the second, rank 1's
    first bias (a dense layer: its NaN reaches the mean) turns NaN."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = LocalSteps(model, sync_every=H, plan=Plan.uniform("topk", ratio=0.1), min_compress_numel=256,
                       outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    seen = {}
    for step in range(1, 3 * H + 1):
        inner_step(model, opt, rank, step)
        if step == 2 * H:
            if rank == 1:
                with torch.no_grad():
                    model[0].bias[0] = float("nan")
            seen["kept_before"] = _feedback(local)
        applied = local.step()
        if step % H == 0:
            weights = flat(model.parameters())
            seen[step] = {"applied": applied, "feedback": _feedback(local), "finite": bool(weights.isfinite().all()),
                          "global": torch.equal(weights, torch.cat([p.detach().reshape(-1) for p in local.global_params])),
                          "equal": torch.equal(*gather(weights)), "merged": local.merged,
                          "counts": (local.outer_steps, local.skipped_outer)}
    return seen


def test_a_skipped_sync_drops_every_rank_s_feedback_and_sends_it_back_to_the_global_weights():
    for seen in run_distributed(_skipped_sync_run, 2):
        assert seen["kept_before"]["residuals"]  # the first sync left residuals to drop
        skipped = seen[2 * H]
        # no outer step; the interval's weights and the error feedback that folded the NaN in
        # are dropped on every rank, which start again from the same global weights
        assert not skipped["applied"] and skipped["counts"] == (1, 1)
        assert skipped["feedback"] == {key: [] for key in seen["kept_before"]}
        assert skipped["finite"] and skipped["global"] and skipped["equal"] and skipped["merged"]
        after = seen[3 * H]  # and the next sync is an ordinary one
        assert after["applied"] and after["counts"] == (2, 1) and after["finite"] and after["equal"]
        assert after["feedback"]["residuals"]
