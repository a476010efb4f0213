"""The adaptive policy's cost model prices the number of ranks W: per rank and step an
all-gather (Top-K) receives W-1 payloads, the all-reduce-shaped transports (dense, the
casts, the scalable quantized route, PowerSGD's factors) send 2(W-1)/W of theirs, so a
low-rank payload stays the same size at every W while a sparse one grows with it. With a
``decode_rate`` an all-gather's decode of W payloads is priced too, and taken out of what
a measured interval teaches the round overheads."""

from __future__ import annotations

import math

import pytest

from raycomp.controllers.policies.cost_model import CostModel
from raycomp.controllers.state import RunState, Timing
from raycomp.plan import CompressorSpec, Plan

ROWS, COLS = 1024, 1024
N = ROWS * COLS


TOPK_PAYLOAD = math.ceil(0.01 * N) * 8  # values and int32 indices


def priced(world_size: int, name: str, decode_rate: float | None = None, per_node: int = 1, **params) -> float:
    """The predicted seconds of one 1024x1024 layer on ``name``, at 1 byte/s, no compute and
    no round cost: its bytes per rank and step (plus, with ``decode_rate``, its decode);
    ``per_node``: ranks per node of a two-level run."""
    run = RunState("r", world_size, {"w": [ROWS, COLS]}, "adaptive", {})
    run.per_node = per_node
    model = CostModel(round_seconds=0.0, bandwidth=1.0, decode_rate=decode_rate)
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


@pytest.mark.parametrize("w", [2, 8, 64, 1024])
def test_an_all_gather_decodes_w_payloads_and_the_all_reduce_transports_none(w):
    rate = 0.5  # bytes of payload decoded per second, against the link's 1 byte/s
    decode = priced(w, "topk", rate, ratio=0.01) - priced(w, "topk", ratio=0.01)
    assert decode == pytest.approx(w * TOPK_PAYLOAD / rate)
    for name, params in (("none", {}), ("int8", {}), ("powersgd", {"rank": 2})):
        assert priced(w, name, rate, **params) == pytest.approx(priced(w, name, **params)), name


def test_the_decode_grows_linearly_with_w():
    def decode(w: int) -> float:
        return priced(w, "topk", 1.0, ratio=0.01) - priced(w, "topk", ratio=0.01)

    assert decode(64) / decode(2) == pytest.approx(32.0)
    assert decode(1024) / decode(64) == pytest.approx(16.0)


def test_a_slow_decode_makes_top_k_dearer_than_dense_at_fewer_ranks_than_bytes_alone():
    """Decoding as slowly as the link moves bytes, Top-K 1% pays (W-1) + W payloads against
    dense's ring: it crosses near W = 50 instead of 100."""
    assert priced(64, "topk", ratio=0.01) < priced(64, "none")  # bytes alone: still cheaper
    assert priced(64, "topk", 1.0, ratio=0.01) > priced(64, "none", 1.0)
    assert priced(32, "topk", 1.0, ratio=0.01) < priced(32, "none", 1.0)


def _top_k_interval(world: int, bandwidth: float, decode_s: float) -> RunState:
    """A run whose one 1M-element vector went on Top-K 1% for steps 10-19, its communication
    exactly its bytes at ``bandwidth`` plus ``decode_s`` a step."""
    run = RunState("r", world, {"v": [N]}, "adaptive", {})
    run.plan = Plan.uniform("topk", ratio=0.01)
    run.layers["v"].compressor = "topk"
    wire, dense = (world - 1) * TOPK_PAYLOAD, 2 * (world - 1) / world * 4 * N  # per rank and step
    comm = wire / bandwidth + decode_s
    for step, steps in ((9, 10), (19, 20)):
        run.timings.append(Timing(step, 0.1 + comm, 0.1, comm, 1.0, wire * world * steps,
                                  dense * world * steps, world))
    return run


def test_a_measured_interval_does_not_count_the_decode_twice():
    """The interval's residual beyond its bytes is exactly the decode the model predicts:
    with a decode_rate it leaves the Top-K family's round overhead at 0 and the model
    predicts the measured step; without one the overhead holds the decode."""
    world, bandwidth, rate = 8, 12.5e6, 30e6
    decode_s = world * TOPK_PAYLOAD / rate
    run = _top_k_interval(world, bandwidth, decode_s)
    model = CostModel(round_seconds=0.001, bandwidth=bandwidth, decode_rate=rate)
    model.measure(run)
    assert model.overhead["topk"] == pytest.approx(0.0, abs=1e-9)
    predicted, _ = model.predict(run, {"v": CompressorSpec.of("topk", ratio=0.01)})
    assert predicted == pytest.approx(run.timings[-1].step_seconds)

    plain = CostModel(round_seconds=0.001, bandwidth=bandwidth)
    plain.measure(run)
    assert plain.overhead["topk"] == pytest.approx(decode_s)


def test_a_residual_smaller_than_the_predicted_decode_is_clipped_at_zero():
    run = _top_k_interval(8, 12.5e6, 0.0)
    model = CostModel(round_seconds=0.001, bandwidth=12.5e6, decode_rate=30e6)
    model.measure(run)
    assert model.overhead["topk"] == 0.0


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (4, 2), (2, 4), (8, 8)])
def test_two_levels_price_the_nodes_link_with_l_pieces_at_k_ranks(nodes, per_node):
    """A compressed plan of a two-level run sends, per node, L pieces of 1/L of each layer
    across K nodes (its rounds and decode at K); a dense plan stays the flat ring at W."""
    w = nodes * per_node
    rows = ROWS // per_node  # a piece: whole rows
    reduce_k = 2 * (nodes - 1) / nodes
    assert priced(w, "none", per_node=per_node) == pytest.approx(2 * (w - 1) / w * 4 * N)
    assert priced(w, "topk", per_node=per_node, ratio=0.01) == pytest.approx(
        per_node * (nodes - 1) * math.ceil(0.01 * rows * COLS) * 8)
    assert priced(w, "powersgd", per_node=per_node, rank=2) == pytest.approx(
        per_node * reduce_k * 4 * (rows + COLS) * 2)
    assert priced(w, "int8", per_node=per_node) == pytest.approx(
        per_node * reduce_k * (rows * COLS + 8 * math.ceil(rows * COLS / 2048)))
    decode = priced(w, "topk", 0.5, per_node=per_node, ratio=0.01) - priced(w, "topk", per_node=per_node, ratio=0.01)
    assert decode == pytest.approx(nodes * math.ceil(0.01 * rows * COLS) * 8 / 0.5)
    # the point of it: an all-gather's node bytes fall by (W - 1) / (K - 1) against flat
    assert priced(w, "topk", ratio=0.01) / priced(w, "topk", per_node=per_node, ratio=0.01) == \
        pytest.approx((w - 1) / (nodes - 1), rel=1e-3)


def test_a_two_level_runs_dense_price_keeps_the_element_size_a_dense_step_measured():
    """A two-level compressed step counts only its piece's dense bytes; priced from those,
    fp32 read as 2 bytes an element and a dense step as half its cost after every
    compressed interval."""
    world, per_node, bandwidth = 4, 2, 1e8
    run = RunState("r", world, {"w": [ROWS, COLS]}, "adaptive", {})
    run.per_node = per_node
    flat = 2 * (world - 1) / world * 4 * N  # a rank's dense bytes of a step
    layer = run.layers["w"]
    layer.compressor, layer.dense_bytes = "none", world * flat
    run.timings.append(Timing(9, 0.1 + flat / bandwidth, 0.1, flat / bandwidth, 1.0,
                              world * flat * 10, world * flat * 10, world))
    model = CostModel(round_seconds=0.0)
    model.measure(run)
    dense = model.predict(run, {})[0]
    assert dense == pytest.approx(0.1 + flat / bandwidth)
    run.plan = Plan.uniform("int8")
    layer.compressor, layer.dense_bytes = "int8", world * flat / per_node  # the piece's, as the ledger counts
    wire = flat / 4 / per_node
    run.timings.append(Timing(19, 0.2, 0.15, 0.05, 1.0, world * (flat * 10 + wire * 10),
                              world * (flat * 10 + flat / per_node * 10), world))
    model.measure(run)
    assert model.overhead  # the interval was measured as compressed
    assert model.predict(run, {})[0] == pytest.approx(dense)


def test_a_two_level_compressed_step_pays_the_nodes_own_hops_at_the_timed_node_link():
    """A two-level compressed step reduce-scatters and all-gathers inside the node: an
    all-reduce of the whole gradient there, at the node's timed seconds per byte; the dense
    plan (one flat all-reduce) pays none of it, and a measured interval's round overhead
    does not count it again."""
    world, per_node, node_link = 4, 2, 1e-9
    run = RunState("r", world, {"w": [ROWS, COLS]}, "adaptive", {})
    run.per_node = per_node
    model = CostModel(round_seconds=0.0, bandwidth=1e8)
    model.state.compute = 0.1
    untimed = model.predict(run, {"w": CompressorSpec.of("int8")})[0]
    dense = model.predict(run, {})[0]
    run.node_link = node_link
    inside = 2 * (per_node - 1) / per_node * 4 * N * node_link
    assert model.node_allreduce(run) == pytest.approx(inside)
    assert model.predict(run, {"w": CompressorSpec.of("int8")})[0] == pytest.approx(untimed + inside)
    assert model.predict(run, {})[0] == pytest.approx(dense)
    run.per_node = 1  # flat: no node of its own
    assert model.node_allreduce(run) == 0.0
    run.per_node = per_node
    # an int8 interval that stepped exactly as priced teaches int8 no overhead of its own
    run.plan = Plan.uniform("int8")
    layer = run.layers["w"]
    layer.compressor, layer.dense_bytes = "int8", world * 2 * (world - 1) / world * 4 * N / per_node
    model.state.element["w"] = 4.0  # as a dense interval before it measured
    wire = (untimed - 0.1) * 1e8 / per_node  # a rank's bytes: the node's are per_node times them
    run.timings.append(Timing(0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, world))
    run.timings.append(Timing(10, untimed + inside, 0.1, untimed + inside - 0.1, 1.0, world * wire * 10,
                              1.0 + world * wire * 40, world))
    model.measure(run)
    assert model.overhead == {"quantized": pytest.approx(0.0, abs=1e-9)}


@pytest.mark.parametrize("per_node", [2, 4])
def test_a_two_level_runs_first_statistics_from_a_compressed_step_price_dense_whole(per_node):
    """Before any dense interval with statistics, a layer's element size comes from its
    latest statistics; a two-level compressed step's count each layer's 1/L piece on the
    ring of the K nodes (the reducer's send group), so they are read as such: fp32 stays 4
    bytes and a dense step its whole cost."""
    nodes = 2
    world = nodes * per_node
    run = RunState("r", world, {"w": [ROWS, COLS], "b": [ROWS]}, "adaptive", {})
    run.per_node = per_node
    flat = 2 * (world - 1) / world * 4  # a rank's dense bytes per element of a step
    piece = 2 * (nodes - 1) / nodes * 4 / per_node  # what a rank's statistics count per element
    run.layers["w"].compressor, run.layers["w"].dense_bytes = "bf16", world * piece * N
    run.layers["b"].compressor, run.layers["b"].dense_bytes = "none", world * piece * ROWS  # cut too
    model = CostModel(round_seconds=0.0, bandwidth=1.0)
    model.state.compute = 0.0
    assert model.predict(run, {})[0] == pytest.approx(flat * (N + ROWS))
    run.per_node = 1  # flat: the statistics count whole layers
    run.layers["w"].dense_bytes, run.layers["b"].dense_bytes = world * flat * N, world * flat * ROWS
    assert model.predict(run, {})[0] == pytest.approx(flat * (N + ROWS))


def test_a_dense_intervals_own_bytes_size_the_elements_whatever_the_statistics_say():
    """A dense interval's bytes are a flat ring's of the whole model: they give the element
    size before any layer's dense statistics have been seen (the statistics of a two-level
    run's compressed steps count pieces)."""
    world = 4
    run = RunState("r", world, {"w": [ROWS, COLS]}, "adaptive", {})
    run.per_node = 2
    flat = 2 * (world - 1) / world * 2 * N  # a rank's dense bytes of a step, bf16 gradients
    run.timings.append(Timing(9, 0.2, 0.1, 0.1, 1.0, world * flat * 10, world * flat * 10, world))
    model = CostModel(round_seconds=0.0, bandwidth=1.0)
    model.measure(run)
    assert model.state.model_element == 2.0
    assert model.predict(run, {})[0] == pytest.approx(0.1 + flat)


def test_a_mixed_precision_model_is_priced_by_each_layers_own_element_size():
    """A dense interval's statistics size each layer (fp32 here, bf16 there); the whole
    model's average (3 bytes) stands in only for a layer not seen dense."""
    world = 2
    run = RunState("r", world, {"w": [ROWS, COLS], "h": [ROWS, COLS]}, "adaptive", {})
    ring = 2 * (world - 1) / world
    for name, size in (("w", 4), ("h", 2)):
        run.layers[name].compressor, run.layers[name].dense_bytes = "none", world * ring * size * N
    sent = ring * 6 * N  # a rank's dense bytes of a step
    run.timings.append(Timing(9, 0.2, 0.1, 0.1, 1.0, world * sent * 10, world * sent * 10, world))
    model = CostModel(round_seconds=0.0, bandwidth=1.0)
    model.measure(run)
    assert model.state.element == {"w": 4.0, "h": 2.0}
    assert model.predict(run, {})[0] == pytest.approx(0.1 + sent)


def test_a_model_sharded_per_node_prices_every_plan_in_two_levels_and_its_shards_sharing_the_link():
    """FSDP sharded per node (:mod:`raycomp._internal.fsdp.two_level`): a dense step too reduce-
    scatters inside the node (at the timed node link) and all-reduces each rank's 1/L shard
    across the K nodes, the L shards of a node on its link at once. A dense interval's
    bytes (a rank's shard on the ring of K nodes) calibrate the link as the node's; the
    compressed plans are priced per shard as a two-level DDP step's pieces."""
    nodes, per_node, bandwidth, node_link, compute = 2, 2, 1e8, 1e-9, 0.1
    world = nodes * per_node
    run = RunState("r", world, {"u": [N]}, "adaptive", {})
    run.per_node, run.node_link = per_node, node_link
    reduce_k = 2 * (nodes - 1) / nodes
    wire = reduce_k * 4 * N / per_node  # a rank's bytes of a dense step: its shard across nodes
    inside = (per_node - 1) / per_node * 4 * N * node_link  # the reduce-scatter inside the node
    comm = inside + per_node * wire / bandwidth
    run.layers["u"].compressor, run.layers["u"].dense_bytes = "none", world * wire
    run.timings.append(Timing(9, compute + comm, compute, comm, 1.0, world * wire * 10, world * wire * 10, world))
    model = CostModel(round_seconds=0.0, sharded=True)
    model.measure(run)
    assert model.bw == pytest.approx(bandwidth)
    assert model.state.model_element == 4.0 and model.state.element == {"u": 4.0}
    assert model.levels(run, {}) == (nodes, per_node)
    assert model.predict(run, {})[0] == pytest.approx(compute + comm)
    shard = N // per_node
    int8 = per_node * reduce_k * (shard + 8 * math.ceil(shard / 2048))
    assert model.predict(run, {"u": CompressorSpec.of("int8")})[0] == pytest.approx(compute + inside + int8 / bandwidth)
    # flat FSDP: one reduce-scatter over every rank, nothing inside a node
    run.per_node = 1
    run.layers["u"].dense_bytes = world * (world - 1) / world * 4 * N  # a flat reduce-scatter's
    flat = CostModel(round_seconds=0.0, bandwidth=bandwidth, sharded=True)
    flat.state.compute = compute
    assert flat.levels(run, {}) == (world, 1)
    assert flat.predict(run, {})[0] == pytest.approx(compute + (world - 1) / world * 4 * N / bandwidth)
