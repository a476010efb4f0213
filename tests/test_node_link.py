"""Timing the link inside a node (raycomp._internal.node_link) on real gloo processes: the nodes time
their own node's group at once, with one untimed and PROBE_ROUNDS timed all-reduces of the
model's gradient size there and nothing across nodes, and divide by what a rank of a ring
sends; a flat run times nothing."""

from __future__ import annotations

import types

import pytest
from torch import nn

import raycomp._internal.node_link
from raycomp._internal.ddp.hook import CompressionState
from raycomp._internal.node_link import PROBE_ROUNDS
from raycomp._internal.topology import Topology
from tests.distributed import run_distributed
from tests.support.wire import WireRecorder

ROUND_SECONDS = 0.5  # what the clock says each timed round took


def _time(rank: int, world: int, per_node: int) -> dict:
    clock = iter([10.0, 10.0 + PROBE_ROUNDS * ROUND_SECONDS])  # read before and after the timed rounds
    raycomp._internal.node_link.time = types.SimpleNamespace(perf_counter=lambda: next(clock))  # this process only
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 10))
    with CompressionState(model, topology=Topology.of_rank(rank, world // per_node, per_node)) as state:
        with WireRecorder() as recorder:
            seconds = state.time_node_link()
        intra = state.levels.intra.handle.group_name if state.levels else None
    return {"seconds": seconds, "intra": intra, "calls": [(c.op, c.numel, c.group) for c in recorder.calls]}


@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (6, 3), (4, 1)], ids=["2x2", "2x3", "4x1"])
def test_each_node_times_its_own_link_with_the_models_gradient_size(world, per_node):
    numel = 256 * 128 + 128 + 128 * 10 + 10
    results = run_distributed(_time, world, per_node)
    for rank, r in enumerate(results):
        if per_node == 1:
            assert r["seconds"] is None and r["calls"] == [], rank  # flat: nothing to time
            continue
        assert r["calls"] == [("all_reduce", numel, r["intra"])] * (1 + PROBE_ROUNDS), rank
        # seconds per byte a rank sends: a timed round over a ring's 2(L-1)/L of the buffer
        sent = 2 * (per_node - 1) / per_node * numel * 4
        assert r["seconds"] == pytest.approx(ROUND_SECONDS / sent), rank
    if per_node > 1:  # each node on its own group
        groups = [r["intra"] for r in results]
        assert len(set(groups)) == world // per_node
        assert all(groups[i] == groups[i - i % per_node] for i in range(world)), groups
