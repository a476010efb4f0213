"""The adaptive policy's cost model prices the number of ranks W: per rank and step an
all-gather (Top-K) receives W-1 payloads, the all-reduce-shaped transports (dense, the
casts, the scalable quantized route, PowerSGD's factors) send 2(W-1)/W of theirs, so a
low-rank payload stays the same size at every W while a sparse one grows with it."""

from __future__ import annotations

import math

import pytest

from raycomp.controllers.policies.cost_model import CostModel
from raycomp.controllers.state import RunState
from raycomp.plan import CompressorSpec

ROWS, COLS = 1024, 1024
N = ROWS * COLS


def priced(world_size: int, name: str, **params) -> float:
    """The predicted seconds of one 1024x1024 layer on ``name``, at 1 byte/s, no compute and
    no round cost: its bytes per rank and step."""
    run = RunState("r", world_size, {"w": [ROWS, COLS]}, "adaptive", {})
    model = CostModel(round_seconds=0.0, bandwidth=1.0)
    model.state.compute = 0.0
    return model.predict(run, {"w": CompressorSpec.of(name, **params)})[0]


@pytest.mark.parametrize("w", [2, 3, 4, 8, 64])
def test_each_transport_is_priced_at_its_traffic_for_w_ranks(w):
    reduce = 2 * (w - 1) / w
    assert priced(w, "none") == pytest.approx(reduce * 4 * N)
    assert priced(w, "int8") == pytest.approx(reduce * (N + 8 * math.ceil(N / 2048)))
    assert priced(w, "bf16") == pytest.approx(reduce * 2 * N)
    assert priced(w, "powersgd", rank=2) == pytest.approx(reduce * 4 * (ROWS + COLS) * 2)
    assert priced(w, "topk", ratio=0.01) == pytest.approx((w - 1) * math.ceil(0.01 * N) * 8)


def test_top_k_one_percent_crosses_dense_near_a_hundred_ranks():
    """Top-K 1%'s all-gather (values and int32 indices, 8 bytes an element kept) against
    dense fp32's ring: (W-1) 0.08 N against 8 N (W-1)/W, equal at W = 100."""
    assert priced(64, "topk", ratio=0.01) < priced(64, "none")
    assert priced(128, "topk", ratio=0.01) > priced(128, "none")


def test_from_two_to_four_ranks_the_low_rank_bytes_grow_as_a_ring_while_the_sparse_triple():
    assert priced(4, "powersgd", rank=2) / priced(2, "powersgd", rank=2) == pytest.approx(1.5 / 1.0)
    assert priced(4, "topk", ratio=0.01) / priced(2, "topk", ratio=0.01) == pytest.approx(3.0)
