"""The DDP comm hook on CUDA: every compressor in one model, unused parameters,
``torch.compile`` with Triton kernels, and a plan changed every step along the adaptive
policy's ladder."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp._internal.ddp.buckets import bucket_cap_mb
from raycomp._internal.ddp.hook import CompressionState, compression_hook
from raycomp.plan import DENSE, CompressorSpec, Plan
from tests.gpu.models import mixed_model
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import count_syncs, same_on_every_rank, sites

pytestmark = pytest.mark.gpu


def _train_step(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def mixed_plan(device: torch.device, rank: int, world: int, async_comm: bool) -> str:
    """A layer per compressor, 4 SGD steps: the hook is called, parameters stay finite and
    the same on every rank; host syncs of an inline step counted."""
    model, plan = mixed_model(device)
    ddp = DDP(model, device_ids=[device.index])
    state = CompressionState(ddp, plan, min_compress_numel=256, async_comm=async_comm)
    calls = [0]

    def hook(s, bucket):  # noqa: ANN001 - unannotated: DDP checks hook annotations
        calls[0] += 1
        return compression_hook(s, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        losses.append(float(_train_step(ddp, opt, x, y)))
    assert calls[0] > 0, "DDP never called the comm hook"
    for p in model.parameters():
        assert torch.isfinite(p).all()
    assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
    sync_note = ""
    if not async_comm:
        x = torch.randn(32, 64, device=device)
        y = torch.randint(0, 10, (32,), device=device)
        n_sync, msgs = count_syncs(lambda: _train_step(ddp, opt, x, y))
        sync_note = (f", syncs/step={n_sync} for {len(list(model.parameters()))} parameters "
                     f"({len(plan.layers)} compressed) [{sites(msgs)}]")
    state.close()
    return f"hook calls={calls[0]}, loss {losses[0]:.3f}->{losses[-1]:.3f}{sync_note}"


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 10), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.a(h) + self.b(h) if both else self.a(h)


def unused_head(device: torch.device, rank: int, world: int, async_comm: bool) -> str:
    """``find_unused_parameters``: the hook on a group of its own beside DDP's all-reduce of
    the used parameters, and a layer no rank used keeping its residual (the settling
    callback reads DDP's map on the device)."""
    torch.manual_seed(0)
    model = TwoHeads().to(device)
    ddp = DDP(model, device_ids=[device.index], find_unused_parameters=True, bucket_cap_mb=0.01)
    state = CompressionState(ddp, Plan.uniform("topk", ratio=0.05), min_compress_numel=256,
                             async_comm=async_comm)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    norms = []
    for step in range(4):  # head b: used, used, unused, unused
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x, both=step < 2), y).backward()
        opt.step()
        norms.append(float(state.memory.residual("b.weight").norm()))
    state.close()
    assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
    assert norms[2] == norms[1] == norms[3], f"head b's residual changed while unused: {norms}"
    return f"head b residual {norms[1]:.4f} kept over 2 unused steps"


def _compiled(device: torch.device, rank: int, plan: Plan | None) -> tuple[list[torch.Tensor], list[float]]:
    """6 steps of ``torch.compile(DDP(...))`` (8 buckets: DDPOptimizer splits the graph at
    each), with the hook and its threads unless ``plan`` is None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(),
                          *[m for _ in range(5) for m in (nn.Linear(1024, 1024), nn.ReLU())],
                          nn.Linear(1024, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=bucket_cap_mb(model))
    state = None
    if plan is not None:
        state = CompressionState(ddp, plan, min_compress_numel=256)
        ddp.register_comm_hook(state, compression_hook)
    net = torch.compile(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(6):
        x = torch.randn(64, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        losses.append(float(_train_step(net, opt, x, y)))
    if state is not None:
        state.close()
    assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
    return [p.detach().clone() for p in model.parameters()], losses


def compiled(device: torch.device, rank: int, world: int, plan: str) -> str:
    """The dense plan gives plain compiled DDP's parameters bit for bit; int4 trains."""
    if plan == "dense":
        plain, _ = _compiled(device, rank, None)
        hooked, _ = _compiled(device, rank, Plan())
        diff = max(float((a - b).abs().max()) for a, b in zip(plain, hooked, strict=True))
        assert diff == 0.0, f"the hook's dense plan differs from plain compiled DDP by {diff:.3g}"
        return "bit-identical to plain compiled DDP"
    _, losses = _compiled(device, rank, Plan.uniform("int4"))
    assert all(math.isfinite(v) for v in losses), f"non-finite loss: {losses}"
    return f"loss {losses[0]:.4f}->{losses[-1]:.4f}"


LADDER = [  # plans the adaptive policy can hand out, lossy rungs to dense, one per step
    ["powersgd1"] * 6,
    ["powersgd2", "topk", "int4", "int8", "bf16", "none"],
    ["int4"] * 6,
    ["int8"] * 6,
    ["bf16"] * 6,
    ["bf16", "int8", "none", "powersgd2", "int4", "int8"],
    ["none"] * 6,
    ["int8"] * 6,
]
RUNGS = {"powersgd1": CompressorSpec.of("powersgd", rank=1), "powersgd2": CompressorSpec.of("powersgd", rank=2),
         "topk": CompressorSpec.of("topk", ratio=0.01), "int8": CompressorSpec.of("int8"),
         "int4": CompressorSpec.of("int4"), "bf16": CompressorSpec.of("bf16"), "none": DENSE}


def ladder(device: torch.device, rank: int, world: int) -> str:
    """The plan moves down and up the ladder (PowerSGD, Top-K, int4, int8, bf16, dense), one
    plan per step, error feedback carried across the switches; syncs counted per rung."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())],
                          nn.Linear(128, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index])
    state = CompressionState(ddp, Plan(), min_compress_numel=256, async_comm=False)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    x_all = torch.randn(len(LADDER) * 32, 128, generator=gen).to(device)
    y_all = torch.randint(0, 10, (len(LADDER) * 32,), generator=gen).to(device)
    syncs: dict[str, int] = {}
    losses = []
    for step, rungs in enumerate(LADDER):
        state.set_plan(Plan.per_layer({f"{2 * i}.weight": RUNGS[r] for i, r in enumerate(rungs)}, default=DENSE))
        x, y = x_all[step * 32:(step + 1) * 32], y_all[step * 32:(step + 1) * 32]
        box: list[Any] = []
        syncs["/".join(sorted(set(rungs)))], _ = count_syncs(
            lambda x=x, y=y, box=box: box.append(_train_step(ddp, opt, x, y)))
        losses.append(float(box[0]))
    state.close()
    assert all(math.isfinite(v) for v in losses), f"non-finite loss {losses}"
    for p in model.parameters():
        assert torch.isfinite(p).all(), "non-finite parameter"
    assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
    return (f"{len(LADDER)} plans, loss {losses[0]:.3f}->{losses[-1]:.3f}; syncs/step: "
            + ", ".join(f"{k}={v}" for k, v in syncs.items()))


MIXED = {a: Check(mixed_plan, {"async_comm": a}) for a in (True, False)}
UNUSED = {a: Check(unused_head, {"async_comm": a}) for a in (True, False)}
COMPILED = {p: Check(compiled, {"plan": p}) for p in ("dense", "int4")}
LADDER_CHECK = Check(ladder)
TWO_RANKS = [*MIXED.values(), *UNUSED.values(), *COMPILED.values(), LADDER_CHECK]


@pytest.mark.parametrize("async_comm", [True, False], ids=["threads", "inline"])
def test_hook_trains_a_model_with_every_compressor(ranks: Nccl | TwoRanks, async_comm: bool,
                                                   note: Callable[[str], None]) -> None:
    note(ranks.run(MIXED[async_comm]))


@pytest.mark.parametrize("async_comm", [True, False], ids=["threads", "inline"])
def test_hook_keeps_an_unused_layers_residual(ranks: Nccl | TwoRanks, async_comm: bool,
                                              note: Callable[[str], None]) -> None:
    note(ranks.run(UNUSED[async_comm]))


@pytest.mark.parametrize("plan", ["dense", "int4"])
def test_hook_under_torch_compile(ranks: Nccl | TwoRanks, plan: str, note: Callable[[str], None]) -> None:
    note(ranks.run(COMPILED[plan]))


def test_hook_follows_a_plan_changed_every_step(ranks: Nccl | TwoRanks, note: Callable[[str], None]) -> None:
    note(ranks.run(LADDER_CHECK))
