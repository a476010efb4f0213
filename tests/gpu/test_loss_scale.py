"""fp16 loss scaling through the hook on CUDA (``CompressionState(grad_scaler=...)``): the
memory follows the scale exactly, at no extra host sync, and fp16 autocast trains."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp._internal.ddp.hook import CompressionState, compression_hook
from raycomp.plan import Plan
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import count_syncs, same_on_every_rank, sites

pytestmark = pytest.mark.gpu

SCALES = [2.0**4, 2.0**6, 2.0**3, 2.0**9, 2.0**5, 2.0**2] * 2
PLANS = {"topk": Plan.uniform("topk", ratio=0.01), "int8": Plan.uniform("int8", chunk_size=512),
         "powersgd": Plan.uniform("powersgd", rank=1)}


def _train(device: torch.device, rank: int, plan: Plan, *, scaled: bool, amp: bool,
           steps: int) -> tuple[list[torch.Tensor], list[float], str]:
    """Parameters and losses after ``steps`` of SGD through the hook. ``scaled``: a
    GradScaler whose scale is set to ``SCALES`` in turn; ``amp``: fp16 autocast with a
    GradScaler left to itself, from a scale of 2^24 that overflows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index])
    scaler = None
    if amp:
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24, growth_interval=8)
    elif scaled:
        scaler = torch.amp.GradScaler(device.type, init_scale=SCALES[0])
    state = CompressionState(ddp, plan, min_compress_numel=256, grad_scaler=scaler)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    losses, seen = [], []
    for step in range(steps):
        x = torch.randn(64, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
            loss = nn.functional.cross_entropy(ddp(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            seen.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update(None if amp else SCALES[(step + 1) % len(SCALES)])
        losses.append(float(loss.detach()))
    state.close()
    assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
    backoffs = sum(b < a for a, b in zip(seen, seen[1:], strict=False))
    return [p.detach().clone() for p in model.parameters()], losses, f"scale {seen[:1]}..{seen[-1:]}, {backoffs} backoffs"


def follows_powers_of_two(device: torch.device, rank: int, world: int, plan: str) -> str:
    """Scales set to powers of two, up and down: the run whose memory follows the scale is
    the run without a scaler, bit for bit (as on the CPU: tests/test_loss_scale.py)."""
    plain, _, _ = _train(device, rank, PLANS[plan], scaled=False, amp=False, steps=len(SCALES))
    scaled, _, _ = _train(device, rank, PLANS[plan], scaled=True, amp=False, steps=len(SCALES))
    diff = max(float((a - b).abs().max()) for a, b in zip(plain, scaled, strict=True))
    assert diff == 0.0, f"parameters differ from the run without a scaler by {diff:.3g}"
    return ""


def host_syncs(device: torch.device, rank: int, world: int) -> str:
    """Following the scale costs no host sync: one inline backward after a change of scale,
    with the scaler told to the hook and without."""
    counts = {}
    for follow in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
        ddp = DDP(model, device_ids=[device.index])
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**4)
        state = CompressionState(ddp, PLANS["topk"], min_compress_numel=256, async_comm=False,
                                 grad_scaler=scaler if follow else None)
        ddp.register_comm_hook(state, compression_hook)
        x = torch.randn(64, 64, device=device)
        y = torch.randint(0, 10, (64,), device=device)

        def backward(ddp: DDP = ddp, scaler: torch.amp.GradScaler = scaler,
                     x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()

        for step in range(3):  # the last backward is counted, after a change of scale
            if step == 2:
                counts[follow] = count_syncs(backward)
            else:
                backward()
                scaler.update(2.0 ** (5 + step))
            ddp.zero_grad()
        state.close()
    assert counts[True][0] == counts[False][0], f"followed {counts[True]}, not followed {counts[False]}"
    return f"syncs in a backward: {counts[True][0]} followed, {counts[False][0]} not [{sites(counts[True][1])}]"


def autocast(device: torch.device, rank: int, world: int) -> str:
    """fp16 autocast with a GradScaler left to itself (it backs off, skips those steps and
    grows again), Top-K, 60 steps: the loss stays finite and falls."""
    _, losses, backoffs = _train(device, rank, PLANS["topk"], scaled=True, amp=True, steps=60)
    assert all(math.isfinite(v) for v in losses), f"non-finite loss: {losses}"
    assert sum(losses[-10:]) < sum(losses[:10]), f"loss did not fall: {losses[:3]} .. {losses[-3:]}"
    return f"loss {sum(losses[:10]) / 10:.3f}->{sum(losses[-10:]) / 10:.3f}, {backoffs}"


FOLLOWS = {plan: Check(follows_powers_of_two, {"plan": plan}) for plan in PLANS}
SYNCS = Check(host_syncs)
AUTOCAST = Check(autocast)
TWO_RANKS = [*FOLLOWS.values(), SYNCS, AUTOCAST]


@pytest.mark.parametrize("plan", list(PLANS))
def test_memory_follows_a_scale_set_to_powers_of_two(ranks: Nccl | TwoRanks, plan: str) -> None:
    ranks.run(FOLLOWS[plan])


def test_following_the_scale_costs_no_host_sync(ranks: Nccl | TwoRanks, note: Callable[[str], None]) -> None:
    note(ranks.run(SYNCS))


def test_fp16_autocast_with_a_grad_scaler_trains(ranks: Nccl | TwoRanks, note: Callable[[str], None]) -> None:
    note(ranks.run(AUTOCAST))
