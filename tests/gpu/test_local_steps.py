"""Local steps (:class:`raycomp._internal.local.LocalSteps`) on CUDA: the outer step on the averaged,
compressed pseudo-gradient, the default schedule (one fragment, each sync on the wire for
one inner step) drained and resumed, the staggered fragments with a delay, BatchNorm
buffers, a non-finite pseudo-gradient, and resuming from a checkpoint loaded on the CPU.

Every check also runs on CPU tensors in the default suite (``tests/test_local_steps.py``
covers the algorithm); what these add is the device: the weights, the global copy, the
outer optimizer's state and the residuals stay on the GPU, the ranks agree bit for bit
after every sync, and the inner steps between syncs cost no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from raycomp._internal.local import LocalSteps, nesterov_outer, resolve_delay
from raycomp.plan import Plan
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import count_syncs, cpu_copy, rel_err, same, same_on_every_rank, sites

pytestmark = pytest.mark.gpu

H = 4
STEPS = 16


def _model(device: torch.device, seed: int, dtype: torch.dtype = torch.float32,
           batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                     torch.nn.Tanh(), torch.nn.Linear(256, 4)]
    if batchnorm:
        layers.insert(1, torch.nn.BatchNorm1d(256))
    return torch.nn.Sequential(*layers).to(device, dtype)


def _batch(rank: int, step: int, device: torch.device, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(32, 8, generator=g) + 0.5 * rank  # the ranks see different data
    rule = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))  # labels a model can learn
    return x.to(device, dtype), (x @ rule).argmax(1).to(device)


def _eval_loss(model, device: torch.device) -> float:
    x, y = _batch(0, 10_000, device, next(model.parameters()).dtype)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x).float(), y))


def _inner(model, opt, rank: int, step: int, device: torch.device) -> float:
    x, y = _batch(rank, step, device, next(model.parameters()).dtype)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    total = t.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def train(device: torch.device, rank: int, world: int, plan: str, dtype: str) -> str:
    """16 inner AdamW steps, H=4: the ranks differ between syncs and agree bit for bit after
    each; everything stays on the device; the inner steps cost no host sync; with the dense
    plan and an outer SGD of lr 1 the sync is the exact mean of the ranks' weights; the
    ledger's wire bytes shrink with int8/int4."""
    dt = getattr(torch, dtype)
    model = _model(device, seed=rank, dtype=dt)  # different starts: the constructor broadcasts rank 0's
    assert world == 1 or not same_on_every_rank(list(model.parameters())), "the ranks' seeds gave equal models"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    averaging = plan == "none"
    local = LocalSteps(model, sync_every=H, plan=Plan.uniform(plan),
                       outer_optimizer=(lambda p: torch.optim.SGD(p, lr=1.0)) if averaging else nesterov_outer)
    assert same_on_every_rank(list(model.parameters())), "the constructor did not start the ranks equal"
    inner_syncs, outer_syncs, losses = [], [], [_eval_loss(model, device)]
    for step in range(1, STEPS + 1):
        _inner(model, opt, rank, step, device)
        before = _mean_over_ranks(_flat(model)) if averaging and step % H == 0 else None
        k, msgs = count_syncs(local.step)
        (outer_syncs if step % H == 0 else inner_syncs).append((k, sites(msgs)))
        if step % H == 0:
            assert local.outer_steps == step // H, f"step {step}: {local.outer_steps} outer steps"
            assert same_on_every_rank(list(model.parameters())), f"step {step}: ranks differ after the sync"
            if before is not None:
                e = rel_err(before, _flat(model))
                assert e < 1e-6, f"step {step}: the averaged weights are off the ranks' mean by {e:.2e}"
        elif world > 1:
            assert not same_on_every_rank(list(model.parameters())), f"step {step}: ranks equal between syncs"
    for t in [*model.parameters(), *local.global_params, *getattr(local.reducer.memory, "residuals", {}).values()]:
        assert t.device == device, f"a tensor of the run is on {t.device}"
    assert all(p.dtype == dt for p in model.parameters()), "the weights changed dtype"
    assert all(p.dtype == torch.float32 for p in local.global_params), "the global weights are not fp32"
    for state in local.outer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim():
                assert v.device == device, f"outer optimizer state on {v.device}"
    assert all(k == 0 for k, _ in inner_syncs), f"inner steps synced the host: {inner_syncs}"
    # an outer step reads two flags: this rank's compressed input finite (the reducer's), the mean finite
    assert all(k <= 2 for k, _ in outer_syncs), f"an outer step synced the host more than twice: {outer_syncs}"
    losses.append(_eval_loss(model, device))
    assert losses[-1] < 0.9 * losses[0], f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}"
    ledger = local.reducer.ledger
    notes = [f"loss {losses[0]:.3f}->{losses[-1]:.3f}", f"syncs per outer step {[k for k, _ in outer_syncs]}",
             f"[{outer_syncs[-1][1]}]"]
    if world > 1:
        ratio = ledger.wire_total / ledger.dense_total
        limit = {"none": 1.0 + 1e-9, "int8": 0.3, "int4": 0.16}[plan]
        assert ratio <= limit, f"wire {ratio:.3f} of dense > {limit}"
        notes.append(f"wire {ratio:.3f} of dense")
    return ", ".join(notes)


def overlapped(device: torch.device, rank: int, world: int) -> str:
    """The schedule ``compression.local.delay: auto`` gives one fragment (int4, H=4): each
    sync stays on the wire for one inner step, after which every rank holds the new global
    weights plus its own step taken meanwhile, bit for bit; the inner steps off the
    schedule cost no host sync. A sync still on the wire is drained (``quiesce``, what a
    checkpoint calls first), and the drained state, loaded on the CPU into a fresh model,
    goes on bit for bit as the run that never stopped."""
    delay = resolve_delay("auto", H)
    assert delay == 1, f"auto gave delay {delay} for H={H} and one fragment"

    def run(model, opt, local, steps) -> list[tuple[int, int]]:
        counted, snapshot = [], []
        for step in steps:
            _inner(model, opt, rank, step, device)
            if step % H == 1 and step > 1:  # the sync started after step - 1 is applied now
                moved = [p.detach().float() - s.float() for p, s in zip(model.parameters(), snapshot, strict=True)]
            k, _ = count_syncs(local.step)
            counted.append((step, k))
            if step % H == 0:
                assert not local.quiescent, f"step {step}: the sync is not on the wire"
                snapshot = [p.detach().clone() for p in model.parameters()]
            elif step % H == 1 and step > 1:
                assert local.quiescent and local.outer_steps == step // H, (
                    f"step {step}: {local.outer_steps} outer steps, quiescent {local.quiescent}")
                assert same_on_every_rank(local.global_params), f"step {step}: global weights differ"
                merged = [g.detach() + m for g, m in zip(local.global_params, moved, strict=True)]
                diff = same([p.detach().float() for p in model.parameters()], merged)
                assert not diff, f"step {step}: not the global weights plus the step taken meanwhile: {diff}"
                assert world == 1 or not same_on_every_rank(list(model.parameters())), (
                    f"step {step}: the ranks' own steps during the sync were lost")
        return counted

    model = _model(device, seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = LocalSteps(model, sync_every=H, delay=delay, plan=Plan.uniform("int4"))
    counted = run(model, opt, local, range(1, 13))
    off = [(s, k) for s, k in counted if s % H not in (0, 1) and k]
    assert not off, f"inner steps off the schedule synced the host: {off}"
    assert not local.quiescent
    local.quiesce()
    assert local.quiescent and local.outer_steps == 3, f"{local.outer_steps} outer steps after the drain"
    saved = cpu_copy({"model": model.state_dict(), "opt": opt.state_dict(), "local": local.state_dict()})
    again = _model(device, seed=123)
    again_opt = torch.optim.AdamW(again.parameters(), lr=3e-3)
    again_local = LocalSteps(again, sync_every=H, delay=delay, plan=Plan.uniform("int4"))
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    again_local.load_state_dict(saved["local"])
    for step in range(13, 19):
        for m, o, loc in ((model, opt, local), (again, again_opt, again_local)):
            _inner(m, o, rank, step, device)
            loc.step()
    diff = same(list(model.parameters()), list(again.parameters()))
    assert not diff, f"the run resumed from the drained state: weights {diff}"
    assert local.outer_steps == again_local.outer_steps == 4
    assert all(p.device == device for p in again_local.global_params), "resumed global weights off the device"
    return f"host syncs at a sync's start and finish {[k for s, k in counted if s % H in (0, 1) and s > 1]}"


def streaming(device: torch.device, rank: int, world: int) -> str:
    """Two fragments, delay 1, int4: a sync stays on the wire for one inner step, the outer
    steps are counted per fragment, and ``merge_all`` leaves the ranks bit-identical."""
    model = _model(device, seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = LocalSteps(model, sync_every=H, fragments=2, delay=1, plan=Plan.uniform("int4"))
    for step in range(1, STEPS + 1):
        _inner(model, opt, rank, step, device)
        local.step()
    # fragment 0 starts at steps 2, 6, 10, 14 and fragment 1 at 4, 8, 12, 16, each applied a step later
    assert local.outer_steps == 7, f"{local.outer_steps} outer steps after {STEPS} inner steps, expected 7"
    assert not local.quiescent, "fragment 1's sync of step 16 should still be on the wire"
    local.merge_all()
    assert local.outer_steps == 10 and local.quiescent, f"{local.outer_steps} outer steps after merge_all"
    assert same_on_every_rank(list(model.parameters())), "ranks differ after merge_all"
    assert all(p.device == device for p in local.global_params), "global weights left the device"
    return ""


def buffers(device: torch.device, rank: int, world: int) -> str:
    """BatchNorm's running statistics are averaged at fragment 0's sync (densely, on the
    device); the integer batch counter is left alone."""
    model = _model(device, seed=0, batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSteps(model, sync_every=2, plan=Plan.uniform("int8"))
    bn = model[1]
    _inner(model, opt, rank, 1, device)
    local.step()
    if world > 1:
        assert not same_on_every_rank([bn.running_mean]), "running means equal before the sync"
    _inner(model, opt, rank, 2, device)
    own = bn.running_mean.detach().clone()
    local.step()
    assert same_on_every_rank([bn.running_mean, bn.running_var]), "running statistics differ after the sync"
    assert bn.running_mean.device == device and bn.num_batches_tracked.item() == 2, "buffers moved or counter touched"
    e = rel_err(_mean_over_ranks(own), bn.running_mean)
    assert e < 1e-6, f"running mean is not the ranks' mean (rel {e:.2e})"
    return ""


def non_finite(device: torch.device, rank: int, world: int) -> str:
    """A NaN in the last rank's weights at a sync: every rank skips the outer step and goes
    back to the global weights, which stay finite."""
    model = _model(device, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSteps(model, sync_every=H, plan=Plan.uniform("int8"))
    for step in range(1, H + 1):
        _inner(model, opt, rank, step, device)
        if step == H and rank == world - 1:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        local.step()
    assert local.skipped_outer == 1 and local.outer_steps == 0, (
        f"skipped {local.skipped_outer}, applied {local.outer_steps}")
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a NaN survived the skipped sync"
    assert not same(list(model.parameters()), [g.detach() for g in local.global_params]), "not back at the global weights"
    assert same_on_every_rank(list(model.parameters())), "ranks differ after the skipped sync"
    return ""


def resume(device: torch.device, rank: int, world: int) -> str:
    """Saved mid-interval (after 6 inner steps, H=4, int8 residuals, Nesterov momentum,
    AdamW moments) and loaded on the CPU into a fresh model on the device: 6 more steps
    match the run that never stopped, bit for bit."""
    model = _model(device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = LocalSteps(model, sync_every=H, plan=Plan.uniform("int8"))
    for step in range(1, 7):
        _inner(model, opt, rank, step, device)
        local.step()
    saved = cpu_copy({"model": model.state_dict(), "opt": opt.state_dict(), "local": local.state_dict()})
    again = _model(device, seed=123)
    again_opt = torch.optim.AdamW(again.parameters(), lr=3e-3)
    again_local = LocalSteps(again, sync_every=H, plan=Plan.uniform("int8"))
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    again_local.load_state_dict(saved["local"])
    for step in range(7, 13):
        _inner(model, opt, rank, step, device)
        local.step()
        _inner(again, again_opt, rank, step, device)
        again_local.step()
    diff = same(list(model.parameters()), list(again.parameters()))
    assert not diff, f"the resumed run's weights {diff}"
    assert all(p.device == device for p in again_local.global_params), "resumed global weights off the device"
    assert local.outer_steps == again_local.outer_steps == 3
    return ""


TRAIN = {f"{plan}-{dtype}": Check(train, {"plan": plan, "dtype": dtype})
         for plan, dtype in [("none", "float32"), ("int8", "float32"), ("int4", "float32"), ("int8", "bfloat16")]}
OTHERS = {"overlapped": Check(overlapped), "streaming": Check(streaming), "buffers": Check(buffers),
          "non-finite": Check(non_finite), "resume": Check(resume)}
TWO_RANKS = [*TRAIN.values(), *OTHERS.values()]


@pytest.mark.parametrize("label", list(TRAIN))
def test_local_steps_merge_the_ranks_at_every_sync_on_the_device(ranks: Nccl | TwoRanks, label: str,
                                                                  note: Callable[[str], None]) -> None:
    note(ranks.run(TRAIN[label]))


@pytest.mark.parametrize("label", list(OTHERS))
def test_local_steps_fragments_buffers_non_finite_and_resume(ranks: Nccl | TwoRanks, label: str) -> None:
    ranks.run(OTHERS[label])
