"""Local steps between nodes, 2 nodes x 2 ranks of real gloo processes: a node is one replica.

Inner steps are data-parallel inside the node (DDP's buckets all-reduced over the node's
group by the hook, dense): the ranks of a node hold the same weights after every step, the
two nodes drift apart, and each inner gradient is the node's mean. Every ``sync_every``
steps the pseudo-gradient crosses nodes in pieces (:class:`raycomp._internal.reduce.two_level.TwoLevelReducer`),
and every rank ends the sync with the mean of the nodes' weights. At torch.distributed, the
cross-node bytes of an int8 sync are what the ledger says, under half of a flat run's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp._internal.local import LocalSteps
from raycomp._internal.reduce.two_level import TwoLevelReducer
from raycomp._internal.topology import Topology
from raycomp._internal.train.local_strategy import LocalState
from raycomp.config import LocalSection
from raycomp.plan import CompressorSpec, LocalMode
from tests.distributed import run_distributed
from tests.support.ranks import flat, gather
from tests.support.wire import WireRecorder, transmitted_bytes

NODES, PER_NODE, SYNC_EVERY, STEPS = 2, 2, 4, 12
WORLD = NODES * PER_NODE


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _build(topology: Topology | None, pseudo: str, delay: int = 0, fragments: int = 1) -> tuple:
    model = DDP(_model(), bucket_cap_mb=0.01)
    state = CompressionState(model, Plan(), min_compress_numel=0, topology=topology)
    model.register_comm_hook(state, compression_hook)
    two_level = isinstance(state.reducer, TwoLevelReducer)
    outer = lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    steps = LocalSteps(model.module, sync_every=SYNC_EVERY, outer_optimizer=outer,
                       min_compress_numel=0, levels=state.reducer.levels if two_level else None)
    local = LocalState(model, state, steps, LocalSection(delay=delay))  # 0: each sync done before the next step
    local.set_plan(Plan(default=CompressorSpec.of(pseudo), local=LocalMode(SYNC_EVERY, fragments)))
    return model, state, steps, local, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), two_level


def _resumed(rank: int, world: int, resume_at: int | None, pseudo: str) -> list[torch.Tensor]:
    """Node replicas under ``pseudo`` syncs and DiLoCo's outer Nesterov; at ``resume_at``
    every object is rebuilt from a checkpoint of model, optimizer and local state."""
    topology = Topology.of_rank(rank, NODES, PER_NODE)
    model, _, _, local, optimizer, _ = _build(topology, pseudo)
    weights = []
    for step in range(STEPS):
        if step == resume_at:
            saved = (model.state_dict(), optimizer.state_dict(), local.state_dict())
            local.close()
            model, _, _, local, optimizer, _ = _build(topology, pseudo)
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            local.load_state_dict(saved[2])
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        local.steps.step()
        weights.append(flat(model.parameters()).clone())
    local.close()
    return weights


def _run(rank: int, world: int, levels: bool, pseudo: str) -> dict:
    topology = Topology.of_rank(rank, NODES, PER_NODE) if levels else None
    model, state, steps, local, optimizer, two_level = _build(topology, pseudo)
    steps.outer = torch.optim.SGD(steps.global_params, lr=1.0)  # model averaging: the mean is checkable
    weights, expected_syncs, grad_error = [], {}, None
    with WireRecorder() as recorder:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            if step == 0:  # this rank's own gradient, beside DDP's, to check the node's mean
                own = _model()
                nn.functional.cross_entropy(own(x), y).backward()
                own_grads = torch.cat([p.grad.reshape(-1) for p in own.parameters()])
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if step == 0:
                reduced = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                every = gather(own_grads)
                node = rank // PER_NODE
                node_mean = torch.stack(every[node * PER_NODE:(node + 1) * PER_NODE]).mean(0)
                grad_error = float((reduced - node_mean).abs().max())
            optimizer.step()
            if (step + 1) % SYNC_EVERY == 0:  # the weights every rank holds before this sync
                expected_syncs[step] = torch.stack(gather(flat(model.parameters()))).mean(0)
            steps.step()
            weights.append(flat(model.parameters()).clone())
    by_group: dict[str, float] = {}
    for call in recorder.calls:
        by_group[call.group] = by_group.get(call.group, 0.0) + transmitted_bytes(call)
    out = {"weights": weights, "expected": expected_syncs, "grad_error": grad_error, "outer": steps.outer_steps,
           "wire": state.ledger.wire_total, "by_group": by_group, "two_level": two_level}
    if two_level:
        out["cross_group"] = state.reducer.levels.cross.handle.group_name
        out["intra_group"] = state.reducer.levels.intra.handle.group_name
        out["intra"] = state.reducer.intra_ledger.wire_total
    local.close()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[tuple[bool, str], list[dict]]:
    return {(levels, pseudo): run_distributed(_run, WORLD, levels, pseudo)
            for levels, pseudo in ((True, "none"), (True, "int8"), (False, "int8"))}


def test_an_inner_gradient_is_the_node_s_mean(runs):
    for rank in runs[True, "none"]:
        assert rank["two_level"] and rank["grad_error"] < 1e-6


def test_a_node_s_ranks_stay_equal_and_the_nodes_drift_between_syncs(runs):
    ranks = runs[True, "int8"]
    drifted = 0
    for step in range(STEPS):
        at = [r["weights"][step] for r in ranks]
        for node in range(NODES):
            assert torch.equal(at[node * PER_NODE], at[node * PER_NODE + 1]), (step, node)
        if (step + 1) % SYNC_EVERY == 0:
            assert all(torch.equal(w, at[0]) for w in at), step  # after each sync, one model
        else:
            drifted += not torch.equal(at[0], at[PER_NODE])
    assert drifted == STEPS - STEPS // SYNC_EVERY
    assert [r["outer"] for r in ranks] == [STEPS // SYNC_EVERY] * WORLD


def test_a_dense_sync_gives_every_rank_the_mean_of_the_nodes(runs):
    """Outer SGD at lr 1 is model averaging: after a dense sync every rank holds the mean
    of the ranks' weights before it (the nodes' mean: a node's ranks are equal)."""
    for rank in runs[True, "none"]:
        for step, expected in rank["expected"].items():
            torch.testing.assert_close(rank["weights"][step], expected, rtol=0, atol=1e-6)


def test_a_sync_crosses_nodes_in_pieces_counted_at_torch_distributed(runs):
    two, flat = runs[True, "int8"], runs[False, "int8"]
    for rank in two:
        assert set(rank["by_group"]) >= {rank["cross_group"], rank["intra_group"]}
        assert rank["wire"] == pytest.approx(rank["by_group"][rank["cross_group"]])
        assert rank["intra"] == pytest.approx(rank["by_group"][rank["intra_group"]])
        assert 0 < rank["wire"] < 0.5 * flat[0]["wire"]  # 1/L of the pseudo-gradient over K ranks, not W


@pytest.mark.parametrize("pseudo", ["int8", "sparseloco"])  # SparseLoCo's residuals per piece too
def test_node_replicas_resume_bit_for_bit_mid_interval(pseudo):
    unbroken = run_distributed(_resumed, WORLD, None, pseudo)
    resumed = run_distributed(_resumed, WORLD, 6, pseudo)  # two inner steps after a sync, two before the next
    for a, b in zip(unbroken, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(unbroken[0][5], unbroken[PER_NODE][5])  # the nodes had drifted when saved


def _overlapped(rank: int, world: int) -> dict:
    """Node replicas with ``delay`` 1: which collectives each ``steps.step()`` issued."""
    topology = Topology.of_rank(rank, NODES, PER_NODE)
    model, state, steps, local, optimizer, _ = _build(topology, "int8", delay=1)
    levels = steps.reducer.levels
    kind = {levels.intra.handle.group_name: "node", levels.cross.handle.group_name: "cross"}
    issued, weights = [], []
    with WireRecorder() as recorder:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            mark = recorder.mark()
            steps.step()
            issued.append(sorted({(c.op, kind.get(c.group, "world")) for c in recorder.since(mark)}))
            weights.append(flat(model.parameters()).clone())
    outer = steps.outer_steps
    local.close()
    return {"issued": issued, "weights": weights, "outer": outer}


def test_a_node_replicas_sync_overlaps_the_delays_inner_step_and_gathers_when_it_lands():
    """With ``delay`` 1 the sync's cross-node hop is left in flight when its step ends; the
    next step finishes it: the node's all-gather of the result goes out then, not before."""
    results = run_distributed(_overlapped, WORLD)
    for result in results:
        assert result["outer"] == STEPS // SYNC_EVERY - 1  # the last sync lands after the last step
        for step, calls in enumerate(result["issued"]):
            gathers = [c for c in calls if c == ("all_gather", "node")]
            if (step + 1) % SYNC_EVERY == 0:  # a sync starts: the node's exchange and the hop out
                assert ("all_to_all_single", "node") in calls and any(c[1] == "cross" for c in calls), (step, calls)
                assert gathers == [], (step, calls)
            elif step % SYNC_EVERY == 0 and step:  # the step after: it lands, the node gathers
                assert gathers == [("all_gather", "node")] and not any(c[1] == "cross" for c in calls), (step, calls)
            else:
                assert calls == [], (step, calls)
    for step in range(STEPS):  # the ranks of a node hold the same weights throughout
        for node in range(NODES):
            first, second = (results[node * PER_NODE + i]["weights"][step] for i in range(PER_NODE))
            assert torch.equal(first, second), (step, node)


def _fragments(rank: int, world: int) -> dict:
    """Node replicas syncing two fragments in turn (Streaming DiLoCo between nodes)."""
    topology = Topology.of_rank(rank, NODES, PER_NODE)
    model, _, steps, local, optimizer, _ = _build(topology, "int8", fragments=2)
    members = steps.fragment_members
    after = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        before = steps.outer_steps
        steps.step()
        params = [p.detach().reshape(-1).clone() for p in model.parameters()]
        after.append({"synced": steps.outer_steps > before,
                      "fragments": [torch.cat([params[i] for i in m]) for m in members]})
    steps.merge_all()
    final = flat(model.parameters()).clone()
    local.close()
    return {"after": after, "final": final, "members": members}


def test_node_replicas_sync_fragments_in_turn_and_each_lands_on_every_rank():
    results = run_distributed(_fragments, WORLD)
    members = results[0]["members"]
    assert len(members) == 2 and all(members)
    synced_fragments = []
    for step in range(STEPS):
        at = [r["after"][step] for r in results]
        for node in range(NODES):  # a node's ranks hold the same weights after every step
            mates = at[node * PER_NODE:(node + 1) * PER_NODE]
            for f in range(2):
                assert torch.equal(mates[0]["fragments"][f], mates[1]["fragments"][f]), (step, node, f)
        if at[0]["synced"]:  # the fragment just synced is equal on every rank, the other not
            equal = [all(torch.equal(a["fragments"][f], at[0]["fragments"][f]) for a in at) for f in range(2)]
            assert equal.count(True) == 1, (step, equal)
            synced_fragments.append(equal.index(True))
    assert set(synced_fragments) == {0, 1} and len(synced_fragments) >= 4, synced_fragments
    assert all(torch.equal(r["final"], results[0]["final"]) for r in results)  # merged at the end
