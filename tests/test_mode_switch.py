"""Every switch of mode leaves the replicas identical (real gloo processes).

A forced sequence per step -> local steps -> per step -> local steps -> per step, each switch
made with a sync of local steps still on the wire (``delay`` 1: the sync started by the step
before the switch is in flight when the plan changes), flat at W = 2 and in two levels at
2 nodes x 2 ranks, with an optimizer that keeps state (SGD with momentum, AdamW) and a
BatchNorm layer. After every step each rank's parameters are gathered: during per-step plans
every rank holds the same weights, and the optimizer's state too; during local steps the
ranks of a node hold the same weights (two levels), the replicas drift apart, and the
first per-step step after a switch finds them equal again.

The steps follow :class:`raycomp._internal.train.loop.TrainLoop`'s order: backward, the optimizer
step, the strategy's after-step work (a sync starts or lands), then a new plan installed
for the next step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raycomp._internal.topology import Topology
from raycomp.plan import CompressorSpec, LocalMode, Plan
from tests.distributed import run_distributed
from tests.support.ranks import gather

H = 4
#: the plan in force from each step on: per step, local steps of H, per step again, local
#: steps in two fragments, local steps of 2, per step. Every switch out of local steps comes
#: one step after a sync started, so it meets that sync on the wire: H's sync starts at the
#: stretch's 4th step (step 6), the second fragment's at its 4th (step 14), H = 2's at its
#: 2nd (step 16)
SEQUENCE = {0: None, 3: LocalMode(H), 7: None, 11: LocalMode(H, fragments=2), 15: LocalMode(2), 17: None}
LEAVING = [7, 15, 17]  # the switches out of a local mode
STEPS = 21


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(16, 8, generator=gen) + rank, torch.randint(0, 4, (16,), generator=gen)


def _flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    # parameters only: BatchNorm's running statistics differ after every forward under DDP
    # too (rank 0's are broadcast at the start of the next forward)
    weights = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    moments = [v.detach().reshape(-1).float() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)]
    return weights, torch.cat(moments) if moments else torch.zeros(0)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _switching(rank: int, world: int, levels: bool, kind: str) -> list[dict]:
    from raycomp._internal.ddp.hook import CompressionState, compression_hook
    from raycomp._internal.local import LocalSteps
    from raycomp._internal.reduce.two_level import TwoLevelReducer
    from raycomp._internal.train.local_strategy import LocalState, LocalStepsStrategy
    from raycomp.config import LocalSection

    topology = Topology.of_rank(rank, 2, world // 2) if levels else None
    model = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hook = CompressionState(model, Plan(), min_compress_numel=0, topology=topology)
    model.register_comm_hook(hook, compression_hook)
    node = hook.reducer.levels if isinstance(hook.reducer, TwoLevelReducer) else None
    steps = LocalSteps(model.module, sync_every=H, min_compress_numel=0, delay=1, levels=node,
                       outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True))
    optimizer = _optimizer(kind, model.parameters())
    state = LocalState(model, hook, steps, LocalSection(delay=1), optimizer)
    strategy = LocalStepsStrategy(model, state)
    int4 = CompressorSpec.of("int4")
    seen = []
    for step in range(STEPS):
        if step in SEQUENCE:  # installed after the step before, as TrainLoop._install does
            mode = SEQUENCE[step]
            in_flight = not steps.quiescent
            state.set_plan(Plan(version=step, default=int4 if mode else CompressorSpec.of("none"), local=mode))
        else:
            in_flight = None
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        strategy.end_backward()
        optimizer.step()
        strategy.after_optimizer_step(True, 0.0)
        weights, moments = _flat_state(model.module, optimizer)
        seen.append({"step": step, "per_step": strategy.per_step, "in_flight_at_switch": in_flight,
                     "weights": gather(weights), "moments": gather(moments)})
    state.close()
    return seen


@pytest.fixture(scope="module", params=[(False, "sgd"), (False, "adamw"), (True, "adamw")],
                ids=["flat-sgd-momentum", "flat-adamw", "two-levels-adamw"])
def switched(request) -> tuple[bool, list[dict]]:
    levels, kind = request.param
    return levels, run_distributed(_switching, 4 if levels else 2, levels, kind)[0]


def _distinct(tensors: list[torch.Tensor]) -> int:
    return len({tuple(t.tolist()) for t in tensors})


def test_each_switch_back_to_per_step_meets_a_sync_on_the_wire(switched):
    _, seen = switched
    assert [s["in_flight_at_switch"] for s in seen if s["step"] in LEAVING] == [True, True, True]


def test_every_rank_holds_the_same_weights_and_optimizer_state_after_every_per_step_step(switched):
    _, seen = switched
    per_step = [s for s in seen if s["per_step"]]
    assert len(per_step) == 3 + 4 + 4
    diverged = [s["step"] for s in per_step if _distinct(s["weights"]) > 1]
    assert diverged == []
    moments_apart = [s["step"] for s in per_step if _distinct(s["moments"]) > 1]
    assert moments_apart == []


def test_during_local_steps_replicas_drift_and_a_node_s_ranks_stay_together(switched):
    levels, seen = switched
    local = [s for s in seen if not s["per_step"]]
    assert len(local) == 4 + 4 + 2
    assert all(_distinct(s["weights"]) > 1 for s in local[:2])  # replicas apart between syncs
    if levels:  # ranks 0, 1 are node 0; 2, 3 node 1
        assert all(torch.equal(s["weights"][0], s["weights"][1]) and torch.equal(s["weights"][2], s["weights"][3])
                   for s in local)


def _equalized(rank: int, world: int, layout_differs: bool) -> dict:
    """Each rank's own Adam state (rank 1 skipped a step, or, with ``layout_differs``, every
    step, so that it holds no state at all) and its own GradScaler scale, then
    :func:`~raycomp._internal.local.equalize_inner_state`."""
    from raycomp._internal.local import equalize_inner_state

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 + rank))
    steps = 0 if layout_differs and rank == 1 else 3 - rank
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * rank + step))
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    mine = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()}
    before = [mine[id(p)] for p in model.parameters()]
    equalize_inner_state(optimizer, scaler, None)
    after = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    return {"before": before, "after": after, "scale": scaler.get_scale(),
            "tracker": None if scaler._growth_tracker is None else int(scaler._growth_tracker)}


def test_equal_layouts_average_the_moments_and_take_rank_0_s_step_count():
    ranks = run_distributed(_equalized, 2, False)
    for k, (zero, one) in enumerate(zip(ranks[0]["after"], ranks[1]["after"], strict=True)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(zero[key], one[key])
            mean = (ranks[0]["before"][k][key].double() + ranks[1]["before"][k][key].double()) / 2
            assert torch.allclose(zero[key].double(), mean, rtol=1e-6)
        assert float(zero["step"]) == float(one["step"]) == 3.0  # rank 0 took 3 steps, rank 1 only 2
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0 ** 10  # the smaller scale
    assert ranks[0]["tracker"] == ranks[1]["tracker"] == 0


def test_a_rank_without_state_takes_rank_0_s_whole_state():
    ranks = run_distributed(_equalized, 2, True)
    assert ranks[1]["before"] == [{}, {}]
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0 ** 10  # rank 1's scaler was never used
    for zero, one in zip(ranks[0]["after"], ranks[1]["after"], strict=True):
        assert zero.keys() == one.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(zero[key], one[key]) for key in zero)
