"""A two-level checkpoint restored at another size or layout: every old rank's piece of the
owed correction is accounted for. Real states from 4 gloo processes as 2 nodes x 2 ranks
(Top-K, so every piece holds a residual), merged by raycomp._internal.train.resize for 3 flat ranks and
for 2 nodes x 2 ranks again; the new ranks owe the global mean exactly what the old ones did."""

from __future__ import annotations

import pytest
import torch

from raycomp._internal.reduce.two_level import TwoLevelReducer, cut
from raycomp._internal.topology import Topology, node_groups
from raycomp._internal.train import resize
from raycomp.plan import Plan
from tests.distributed import run_distributed

SHAPES = {"w": (40, 33), "v": (2048,), "b": (3,)}
NAMES = list(SHAPES)
NODES, PER_NODE = 2, 2


def _reducer(rank: int) -> TwoLevelReducer:
    return TwoLevelReducer(node_groups(Topology.of_rank(rank, NODES, PER_NODE)),
                           Plan.uniform("topk", ratio=0.05), min_compress_numel=64)


def _trained(rank: int, world: int) -> dict:
    reducer = _reducer(rank)
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        reducer.reduce(NAMES, [torch.randn(s, generator=gen) for s in SHAPES.values()], closes_step=True)
        reducer.end_step()
    return reducer.state_dict()


def _loaded(rank: int, world: int, merged: list[dict]) -> dict:
    reducer = _reducer(rank)
    reducer.load_state_dict(merged[rank])
    return {"position": reducer.levels.intra.rank, "residuals": reducer.memory.state_dict()["residuals"]}


def _owed(states: list[dict]) -> dict[str, torch.Tensor]:
    """(1/K) sum over nodes of each node's pieces put back in place."""
    owed = {name: torch.zeros(torch.Size(shape).numel(), dtype=torch.float64) for name, shape in SHAPES.items()}
    for state in states:
        place = state["levels"]
        for name, piece in state["memory"]["residuals"].items():
            offset, size, _ = cut(torch.Size(SHAPES[name]), place["per_node"])[place["position"]]
            owed[name][offset:offset + size] += piece.reshape(-1).double()
    return {name: (total / NODES).float().view(SHAPES[name]) for name, total in owed.items()}


@pytest.fixture(scope="module")
def olds() -> list[dict]:
    return run_distributed(_trained, NODES * PER_NODE)


def _merge(olds: list[dict], rank: int, world: int) -> dict:
    return resize.merge_reducer(olds, rank, world, 0, SHAPES)


def test_two_level_states_hold_pieces_and_their_places(olds):
    assert [s["levels"]["position"] for s in olds] == [0, 1, 0, 1]
    assert [s["levels"]["cross_rank"] for s in olds] == [0, 0, 1, 1]
    assert olds[1]["memory"]["residuals"]["w"].shape == (20, 33)  # whole rows of the matrix


def test_merged_for_flat_ranks_every_rank_owes_the_old_mean(olds):
    owed = _owed(olds)
    assert any(t.abs().sum() > 0 for t in owed.values())
    for rank in range(3):
        merged = _merge(olds, rank, 3)
        assert merged["merged"] and "levels" not in merged
        assert set(merged["memory"]["residuals"]) == {"w", "v"}  # "b" is dense: nothing owed
        for name in ("w", "v"):
            torch.testing.assert_close(merged["memory"]["residuals"][name], owed[name])


def test_merged_for_two_levels_each_rank_takes_its_piece_and_the_nodes_owe_the_same(olds):
    merged = [_merge(olds, rank, NODES * PER_NODE) for rank in range(NODES * PER_NODE)]
    loaded = run_distributed(_loaded, NODES * PER_NODE, merged)
    for name, shape in SHAPES.items():
        for node in range(NODES):
            full = torch.zeros(torch.Size(shape).numel())
            for got in loaded[node * PER_NODE:(node + 1) * PER_NODE]:
                offset, size, _ = cut(torch.Size(shape), PER_NODE)[got["position"]]
                if name in got["residuals"]:
                    full[offset:offset + size] = got["residuals"][name].reshape(-1)
            # every node holds the whole owed mean, so the mean over nodes is that mean
            torch.testing.assert_close(full.view(shape), _owed(olds)[name])


def test_a_layout_change_at_the_same_size_is_seen(olds):
    flat = {"memory": {"residuals": {}}, "step": 0}
    assert resize.layout_of(olds[0]) != resize.layout_of(flat)
    assert resize.layout_of(olds[0]) == resize.layout_of(olds[0])
    assert resize.layout_of(olds[0]) != resize.layout_of(olds[1])  # another position on the node
