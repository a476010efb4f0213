"""Two-level reduction on 4 real gloo processes laid out as 2 nodes x 2 ranks: every rank gets
the same mean, the mean is the global one (dense) or the mean of what the nodes' positions
sent (compressed), error feedback keeps each piece's residual on the rank that sent it, and
what crosses nodes is what the cross-node groups carried, at most 1/L of the flat path's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.reduce.two_level import ShardLayout, TwoLevelReducer
from raycomp._internal.topology import Topology, node_groups
from raycomp.plan import Plan
from tests.distributed import run_distributed
from tests.support.wire import WireRecorder, transmitted_bytes

SHAPES = [(64, 33), (5000,), (3,), (16, 8, 3, 3), (1, 2048)]
NAMES = [f"layer{i}" for i in range(len(SHAPES))]
NODES, PER_NODE = 2, 2
STEPS = 3


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _plans() -> dict[str, Plan]:
    return {
        "dense": Plan(),
        "topk": Plan.uniform("topk", ratio=0.05),
        "int4": Plan.uniform("int4", chunk_size=256),
        "powersgd": Plan.uniform("powersgd", rank=2),
    }


def _two_level(rank: int, world: int, plan_name: str, flat: bool) -> dict:
    topology = Topology.of_rank(rank, NODES, PER_NODE)
    levels = node_groups(topology)
    plan = _plans()[plan_name]
    reducer = CompressedReducer(plan, min_compress_numel=64) if flat else \
        TwoLevelReducer(levels, plan, min_compress_numel=64)
    means = []
    with WireRecorder() as recorder:
        for step in range(STEPS):
            reducer.stage_control([float(rank), float(step)])
            means.append(reducer.reduce(NAMES, _grads(rank, step), closes_step=True))
            rows = reducer.control_rows.clone()
            reducer.end_step()
    residuals = {name: reducer.memory.residual(name) for name in NAMES}
    by_group: dict[str, float] = {}
    for call in recorder.calls:
        by_group[call.group] = by_group.get(call.group, 0.0) + transmitted_bytes(call)
    cross = intra = ""
    if levels and not flat:
        cross, intra = levels.cross.handle.group_name, levels.intra.handle.group_name
    return {
        "means": means, "rows": rows, "residuals": residuals, "position": dist.get_rank(levels.intra.handle)
        if levels and not flat else 0, "wire": reducer.ledger.wire_total, "dense": reducer.ledger.dense_total,
        "intra": getattr(reducer, "intra_ledger", None) and reducer.intra_ledger.wire_total,
        "by_group": by_group, "cross_group": cross, "intra_group": intra,
    }


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, bool], list[dict]]:
    return {(name, flat): run_distributed(_two_level, NODES * PER_NODE, name, flat)
            for name in _plans() for flat in (False, True) if not flat or name == "topk"}


def _exact(step: int) -> list[torch.Tensor]:
    grads = [_grads(r, step) for r in range(NODES * PER_NODE)]
    return [torch.stack([g[i] for g in grads]).mean(0) for i in range(len(SHAPES))]


@pytest.mark.parametrize("plan", list(_plans()))
def test_every_rank_gets_the_same_mean(results, plan):
    ranks = results[plan, False]
    for step in range(STEPS):
        for i in range(len(SHAPES)):
            for other in ranks[1:]:
                assert torch.equal(ranks[0]["means"][step][i], other["means"][step][i]), (step, NAMES[i])


def test_a_dense_plan_gives_the_global_mean(results):
    for step in range(STEPS):
        for got, want in zip(results["dense", False][0]["means"][step], _exact(step), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plan", ["topk", "int4", "powersgd"])
def test_error_feedback_telescopes_per_piece(results, plan):
    """Sum over steps of the means, plus the nodes' mean residual (each piece's from the rank
    that sent it), is the sum of the exact means: nothing was lost or counted twice."""
    ranks = results[plan, False]
    for i, name in enumerate(NAMES):
        sent = sum(ranks[0]["means"][step][i] for step in range(STEPS))
        exact = sum(_exact(step)[i] for step in range(STEPS))
        held = torch.zeros(SHAPES[i])
        for node in range(NODES):
            pieces = sorted((r["position"], r["residuals"][name]) for r in ranks[node * PER_NODE:(node + 1) * PER_NODE]
                            if r["residuals"][name] is not None)
            if pieces:
                layout = ShardLayout([torch.Size(SHAPES[i])], PER_NODE)
                full = torch.zeros(layout.numel)
                offset = 0
                for position in range(PER_NODE):
                    for _, _, piece in layout.pieces[position]:
                        residual = dict(pieces).get(position)
                        if residual is not None:
                            full[offset:offset + piece.numel()] = residual.reshape(-1)
                        offset += piece.numel()
                held += full.view(SHAPES[i])
        torch.testing.assert_close(sent + held / NODES, exact, rtol=1e-4, atol=1e-4)
        if plan == "topk" and SHAPES[i][0] > 3:
            assert held.abs().sum() > 0  # Top-K holds something back on a large layer


def test_control_rows_reach_every_rank(results):
    want = torch.tensor([[0.0, float(r), float(STEPS - 1)] for r in range(NODES * PER_NODE)])
    for plan in _plans():
        for rank in results[plan, False]:
            torch.testing.assert_close(rank["rows"], want)


@pytest.mark.parametrize("plan", list(_plans()))
def test_ledgers_are_what_each_level_carried(results, plan):
    for rank in results[plan, False]:
        assert set(rank["by_group"]) == {rank["cross_group"], rank["intra_group"]}
        assert rank["wire"] == pytest.approx(rank["by_group"][rank["cross_group"]])
        assert rank["intra"] == pytest.approx(rank["by_group"][rank["intra_group"]])


def test_cross_node_bytes_are_a_fraction_of_the_flat_paths(results):
    """Top-K's all-gather: flat, each rank receives from W - 1 = 3 ranks; two-level, each
    position's 1/L piece from K - 1 = 1 node: per rank 1/6 of the flat bytes, under 1/L."""
    flat = results["topk", True][0]["wire"]
    two = results["topk", False][0]["wire"]
    assert two <= flat / PER_NODE
    assert results["topk", False][0]["dense"] == pytest.approx(results["dense", False][0]["dense"])


def test_layout_round_trips_and_cuts_rows():
    shapes = [torch.Size(s) for s in SHAPES]
    layout = ShardLayout(shapes, 3)
    tensors = [torch.randn(s) for s in shapes]
    assert all(torch.equal(a, b) for a, b in zip(layout.unpack(layout.pack(tensors)), tensors, strict=True))
    first = [piece for layer, _, piece in layout.pieces[0] if layer == 0][0]
    assert first == torch.Size((22, 33))  # whole rows of the matrix
    tiny = [piece for position in range(3) for layer, _, piece in layout.pieces[position] if layer == 2]
    assert tiny == [torch.Size((1,))] * 3


def _uneven(rank: int, world: int) -> bool:
    # 3 ranks: two on node 0, one on node 1, as Ray Train reports an uneven placement
    place = [Topology(1, 1, 0, 0), Topology(1, 1, 0, 0), Topology(3, 1, 1, 0)][rank]
    return node_groups(place) is None


def test_places_that_do_not_tile_run_flat_on_every_rank():
    assert run_distributed(_uneven, 3) == [True, True, True]
