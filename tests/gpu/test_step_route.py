"""raycomp.train's way of reducing a DDP model on CUDA (:mod:`raycomp._internal.ddp.step_route`): a dense
step is DDP's own reduction (a statistics step reads each rank's own gradient norms on the
way), the hook joins at the first compressed step; the means are DDP's own bit for bit where
the plan is dense, and the same on every rank throughout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp._internal.ddp.hook import CompressionState
from raycomp._internal.ddp.step_route import StepRoute
from raycomp.plan import Plan
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import same_on_every_rank

pytestmark = pytest.mark.gpu

#: the plan installed before each step (None: keep the one in force) and the way expected;
#: statistics every 3 steps fall at steps 2 and 5
STEPS = [(None, "ddp"), (None, "ddp"), (None, "ddp"), ("int8", "hook"), (None, "hook"), ("dense", "hook")]


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10)).to(device)


def ways(device: torch.device, rank: int, world: int) -> str:
    plain = DDP(_model(device), device_ids=[device.index])
    ddp = DDP(_model(device), device_ids=[device.index])
    state = CompressionState(ddp, Plan(), min_compress_numel=0, stats_every=3)
    route = StepRoute(ddp, state)
    gen = torch.Generator().manual_seed(rank)
    seen, equal = [], []
    stats_checked = False
    for plan, _ in STEPS:
        if plan is not None:
            state.set_plan(Plan.uniform(plan) if plan != "dense" else Plan())
        state.stage_control([float(rank + 1)])
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        nn.functional.cross_entropy(plain(x), y).backward()
        own = [float(g.norm()) for g in torch.autograd.grad(nn.functional.cross_entropy(ddp.module(x), y),
                                                            list(ddp.module.parameters()))]
        loss = nn.functional.cross_entropy(ddp(x), y)
        seen.append(route.way.value)
        loss.backward()
        route.end_backward()
        if state.stats_step == state.step - 1 and seen[-1] == "ddp":  # this rank's own norms, not the mean's
            measured = [st.grad_norm for st in state.stats]
            assert measured == pytest.approx(own, rel=1e-5), (measured, own)
            stats_checked = True
        rows = state.control_rows.tolist()
        assert [row[1] for row in rows] == [float(r + 1) for r in range(world)], rows
        equal.append(all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ddp.parameters(),
                                                                       strict=True)))
        assert same_on_every_rank([p.grad for p in ddp.parameters()]), "the means differ across ranks"
        with torch.no_grad():
            for p in (*plain.parameters(), *ddp.parameters()):
                p -= 0.05 * p.grad
        plain.zero_grad()
        ddp.zero_grad()
    state.close()
    assert seen == [way for _, way in STEPS], seen
    assert stats_checked, "no statistics step went DDP's way"
    assert equal[:3] == [True] * 3 and not equal[3], equal  # DDP's mean while dense, then int8's
    return f"ways {seen}, comm {state.comm_seconds * 1e3:.2f} ms in all"


WAYS = Check(ways)
TWO_RANKS = [WAYS]


def test_each_step_takes_its_way_and_a_dense_one_is_ddps_own(ranks: Nccl | TwoRanks,
                                                              note: Callable[[str], None]) -> None:
    note(ranks.run(WAYS))
