"""The DDP hook in two levels, 2 nodes x 2 ranks of real gloo processes: plans switch from
dense to compressed and back at the same step on every rank, the replicas stay bit-identical,
a dense plan gives DDP's mean, and a checkpoint resumes bit for bit (and refuses a flat run)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp._internal.reduce.two_level import TwoLevelReducer
from raycomp._internal.topology import Topology
from tests.distributed import run_distributed

NODES, PER_NODE = 2, 2
DDP_KW = {"bucket_cap_mb": 0.01}  # several buckets: the per-bucket path and the step's end run
#: (first step, plan): dense, per-step compressed by three transports, dense again
SCHEDULE = [(0, Plan()), (2, Plan.uniform("topk", ratio=0.05)), (4, Plan.uniform("int4", chunk_size=128)),
            (6, Plan.uniform("powersgd", rank=2)), (8, Plan())]
STEPS = 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def _step(model, optimizer, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _plan_at(step: int) -> Plan:
    return [plan for start, plan in SCHEDULE if start <= step][-1]


def _train(rank: int, world: int, levels: bool, resume_at: int | None) -> dict:
    topology = Topology.of_rank(rank, NODES, PER_NODE) if levels else None
    model = DDP(_model(), **DDP_KW)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = CompressionState(model, Plan(), min_compress_numel=0, topology=topology)
    model.register_comm_hook(state, compression_hook)
    weights, plans, wire = [], [], []
    for step in range(STEPS):
        state.set_plan(_plan_at(step))
        if step == resume_at:  # a fresh model, optimizer and state from this step's checkpoint
            saved = (state.state_dict(), model.state_dict(), optimizer.state_dict())
            state.close()
            model = DDP(_model(), **DDP_KW)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            state = CompressionState(model, Plan(), min_compress_numel=0, topology=topology)
            model.register_comm_hook(state, compression_hook)
            state.load_state_dict(saved[0])
            model.load_state_dict(saved[1])
            optimizer.load_state_dict(saved[2])
        _step(model, optimizer, rank, step)
        plans.append(state.plan.digest() if hasattr(state.plan, "digest") else repr(state.plan))
        weights.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        wire.append(state.ledger.wire_total)
    out = {"weights": weights, "plans": plans, "two_level": isinstance(state.reducer, TwoLevelReducer),
           "wire": wire}
    if levels:  # a flat state cannot take this checkpoint
        flat = CompressionState(DDP(_model(), **DDP_KW), Plan(), min_compress_numel=0)
        try:
            flat.load_state_dict(state.state_dict())
            out["flat_refused"] = ""
        except ValueError as error:
            out["flat_refused"] = str(error)
        flat.close()
    state.close()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    world = NODES * PER_NODE
    return {"two": run_distributed(_train, world, True, None), "flat": run_distributed(_train, world, False, None),
            "resumed": run_distributed(_train, world, True, 5)}


def test_replicas_stay_identical_through_every_switch(runs):
    ranks = runs["two"]
    assert all(r["two_level"] for r in ranks)
    for step in range(STEPS):
        assert len({r["plans"][step] for r in ranks}) == 1
        for other in ranks[1:]:
            assert torch.equal(ranks[0]["weights"][step], other["weights"][step]), step


def test_dense_steps_give_ddps_mean_and_compressed_ones_depart_from_it(runs):
    two, flat = runs["two"][0]["weights"], runs["flat"][0]["weights"]
    for step in range(2):  # dense: the same mean, summed in another order
        torch.testing.assert_close(two[step], flat[step], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(two[3], flat[3], rtol=1e-5, atol=1e-6)  # each path compresses its own way


def test_two_levels_send_fewer_cross_node_bytes_than_flat(runs):
    """Over the compressed steps (2-7): under 1/L of the flat path's bytes per rank."""
    def compressed(run):
        return run[0]["wire"][7] - run[0]["wire"][1]
    assert 0 < compressed(runs["two"]) < compressed(runs["flat"]) / PER_NODE


def test_a_checkpoint_resumes_bit_for_bit_and_a_flat_state_refuses_it(runs):
    for unbroken, resumed in zip(runs["two"], runs["resumed"], strict=True):
        for step in range(STEPS):
            assert torch.equal(unbroken["weights"][step], resumed["weights"][step]), step
        assert "compression.levels" in unbroken["flat_refused"]
