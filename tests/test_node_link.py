"""Timing the link inside a node (raycomp.node_link) on real gloo processes: two nodes of
two ranks time their own node's group at once, with one untimed and PROBE_ROUNDS timed
all-reduces of the model's gradient size there and nothing across nodes; a flat run times
nothing."""

from __future__ import annotations

import math
import time

import pytest
from torch import nn

from raycomp.hook import CompressionState
from raycomp.node_link import PROBE_ROUNDS
from raycomp.topology import Topology
from tests.distributed import run_distributed
from tests.support.wire import WireRecorder


def _time(rank: int, world: int, per_node: int) -> dict:
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 10))
    with CompressionState(model, topology=Topology.of_rank(rank, world // per_node, per_node)) as state:
        with WireRecorder() as recorder:
            started = time.perf_counter()
            seconds = state.time_node_link()
            wall = time.perf_counter() - started
        intra = state.levels.intra.handle.group_name if state.levels else None
    return {"seconds": seconds, "wall": wall, "intra": intra,
            "calls": [(c.op, c.numel, c.group) for c in recorder.calls]}


@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (4, 1)], ids=["2x2", "4x1"])
def test_each_node_times_its_own_link_with_the_models_gradient_size(world, per_node):
    numel = 256 * 128 + 128 + 128 * 10 + 10
    results = run_distributed(_time, world, per_node)
    for rank, r in enumerate(results):
        if per_node == 1:
            assert r["seconds"] is None and r["calls"] == [], rank  # flat: nothing to time
            continue
        assert r["calls"] == [("all_reduce", numel, r["intra"])] * (1 + PROBE_ROUNDS), rank
        # seconds per byte a rank sends: the timed rounds' mean over a ring's 2(L-1)/L of the buffer
        sent = 2 * (per_node - 1) / per_node * numel * 4
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0, rank
        assert PROBE_ROUNDS * r["seconds"] * sent <= r["wall"], rank
    if per_node > 1:  # each node on its own group: ranks 0, 1 on one, 2, 3 on the other
        groups = [r["intra"] for r in results]
        assert groups[0] == groups[1] != groups[2] == groups[3]
