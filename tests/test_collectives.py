"""Collectives across 2 and 4 real gloo processes: every rank gets the same mean, and the
mean is what the ranks' payloads decompress to; wire bytes follow the documented model.
The scalable transport takes its two rounds at W = 4 and one all-gather at W = 2."""

from __future__ import annotations

import math

import pytest
import torch

from raycomp._internal.transports import (
    Group,
    ScalableAllreduce,
    dense_allreduce,
    lowrank_allreduce,
    sparse_allgather,
    summable_allreduce,
)
from raycomp.compressors import make_compressor
from raycomp.plan import CompressorSpec
from tests.distributed import run_distributed
from tests.support.wire import WireRecorder

SHAPES = [(64, 33), (5000,), (16, 8, 3, 3)]
SPECS = {
    "summable": [("fp16", {}), ("bf16", {}), ("randomk", {"ratio": 0.05})],
    "sparse": [("topk", {"ratio": 0.02}), ("dgc_topk", {"ratio": 0.02}), ("threshold", {"threshold": 1.5})],
    "scalable": [("sign", {}), ("int8", {"chunk_size": 256}), ("int4", {"chunk_size": 256}), ("qsgd", {}),
                 ("terngrad", {})],
    "lowrank": [("powersgd", {"rank": 2})],
}


def _inputs(rank: int, same: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0 if same else rank + 1)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _compressors(name: str, params: dict, rank: int) -> list:
    spec = CompressorSpec.of(name, **params)
    return [spec.build(f"layer{i}", rank) for i in range(len(SHAPES))]


def _all_transports(rank: int, world_size: int) -> dict:
    group = Group()
    out: dict = {}
    xs = _inputs(rank)
    with WireRecorder() as wire:

        def recorded(key: str, mark: int) -> None:
            calls = wire.since(mark)
            out[key + "/wire"] = (sum(c.transmitted for c in calls), [(c.op, c.dtype, c.numel) for c in calls])

        mark = wire.mark()
        out["dense"] = [(r.mean, r.sent, r.wire_bytes) for r in dense_allreduce(xs, group).wait()]
        recorded("dense", mark)
        for name, params in SPECS["summable"]:
            mark = wire.mark()
            res = summable_allreduce(xs, _compressors(name, params, rank), group).wait()
            out[name] = [(r.mean, r.sent, r.wire_bytes) for r in res]
            recorded(name, mark)
        for name, params in SPECS["sparse"]:
            mark = wire.mark()
            res, overhead = sparse_allgather(xs, _compressors(name, params, rank), group).wait()
            out[name] = [(r.mean, r.sent, r.wire_bytes) for r in res] + [overhead]
            recorded(name, mark)
        for name, params in SPECS["lowrank"]:
            mark = wire.mark()
            res = lowrank_allreduce(xs[:1] + xs[2:], _compressors(name, params, rank)[:2], group).wait()
            out[name] = [(r.mean, r.sent, r.wire_bytes) for r in res]
            recorded(name, mark)
        for name, params in SPECS["scalable"]:
            names = [f"layer{i}" for i in range(len(SHAPES))]
            mark = wire.mark()
            res, overhead = ScalableAllreduce()(names, xs, _compressors(name, params, rank), group).wait()
            out[name] = [(r.mean, r.sent, r.wire_bytes) for r in res] + [overhead]
            recorded(name, mark)
            # identical inputs on every rank: recompressing an already-compressed average is
            # (nearly) lossless for sign/int8, so the result must equal one local round trip
            same = _inputs(rank, same=True)
            res, _ = ScalableAllreduce()(names, same, _compressors(name, params, rank), group).wait()
            out[name + "/same"] = [(r.mean, r.sent) for r in res]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def results(request):
    return request.param, run_distributed(_all_transports, request.param)


def _mean_of_sent(per_rank: list[dict], key: str, layer: int) -> torch.Tensor:
    return sum(r[key][layer][1].float() for r in per_rank) / len(per_rank)


def test_every_rank_gets_the_same_mean(results):
    _, per_rank = results
    for key in per_rank[0]:
        if key.endswith("/wire"):
            continue
        for layer, entry in enumerate(per_rank[0][key]):
            if isinstance(entry, tuple):
                for other in per_rank[1:]:
                    assert torch.equal(entry[0], other[key][layer][0]), (key, layer)


def test_dense_is_the_exact_mean(results):
    w, per_rank = results
    for layer in range(len(SHAPES)):
        expected = sum(_inputs(r)[layer] / w for r in range(w))
        torch.testing.assert_close(per_rank[0]["dense"][layer][0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["fp16", "bf16", "randomk", "topk", "dgc_topk", "threshold", "powersgd"])
def test_mean_equals_mean_of_what_each_rank_sent(results, name):
    w, per_rank = results
    # casts sum in their own (half) precision; everything else sums in fp32
    tol = {"fp16": 2e-3, "bf16": 2e-2}.get(name, 1e-5)
    for layer, entry in enumerate(per_rank[0][name]):
        if not isinstance(entry, tuple):
            continue
        expected = _mean_of_sent(per_rank, name, layer)
        torch.testing.assert_close(entry[0].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["sign", "int8", "int4", "qsgd", "terngrad"])
def test_scalable_allreduce_averages_chunks(results, name):
    w, per_rank = results
    for layer, (mean, _, _) in enumerate(per_rank[0][name][:-1]):  # last: overhead
        expected = _mean_of_sent(per_rank, name, layer)
        if w == 2:
            # one all-gather, no recompression: exactly the mean of what the ranks sent
            torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-7)
        elif name in ("int8", "int4"):
            # one recompression of the average: at most half a step (1/255, 1/15) of its chunk range
            span = float(expected.max() - expected.min())
            steps = 255 if name == "int8" else 15
            assert float((mean - expected).abs().max()) <= span / steps / 2 + 1e-5
        else:
            # unbiased/sign recompression keeps the direction: positive correlation
            cos = torch.nn.functional.cosine_similarity(mean.reshape(1, -1), expected.reshape(1, -1))
            assert float(cos) > 0.3, (name, layer, float(cos))
    if name in ("sign", "int8"):
        for mean, sent in per_rank[0][name + "/same"]:
            # the re-derived scale differs from the original by float summation order only
            torch.testing.assert_close(mean, sent, rtol=1e-4, atol=1e-5)


def test_wire_bytes_are_what_the_collectives_transmitted(results):
    # each transport's claimed bytes (per layer + overhead) against the calls it really
    # issued, as tests.support.wire records and prices them
    w, per_rank = results
    for rank, res in enumerate(per_rank):
        for key, entries in res.items():
            if key.endswith("/wire") or key.endswith("/same"):
                continue
            claimed = sum(e[2] if isinstance(e, tuple) else e for e in entries)
            transmitted, _ = res[key + "/wire"]
            assert transmitted > 0, key
            assert claimed == pytest.approx(transmitted, rel=1e-12), (rank, key)


def test_tensors_handed_to_the_collectives(results):
    # the wire tensors for the three layers (64x33, 5000, 16x8x3x3 = 2112, 5000, 1152 elements),
    # worked out from the wire formats in the compressors' docstrings
    w, per_rank = results
    numels = [math.prod(s) for s in SHAPES]
    calls = {key[: -len("/wire")]: v[1] for key, v in per_rank[0].items() if key.endswith("/wire")}
    assert calls["dense"] == [("all_reduce", torch.float32, 8264)]
    assert calls["fp16"] == [("all_reduce", torch.float16, 8264)]
    assert calls["bf16"] == [("all_reduce", torch.bfloat16, 8264)]
    assert calls["randomk"] == [("all_reduce", torch.float32, sum(math.ceil(0.05 * n) for n in numels))]
    k = sum(math.ceil(0.02 * n) for n in numels)  # 43 + 100 + 24 values and int32 indices
    assert calls["topk"] == [("all_gather", torch.uint8, 8 * k)]  # fixed size: no count exchange
    # PowerSGD rank 2 on 64x33 and 16x72: one all-reduce of every P, one of every Q
    assert calls["powersgd"] == [("all_reduce", torch.float32, (64 + 16) * 2), ("all_reduce", torch.float32, (33 + 72) * 2)]
    # variable size: the 6 payload tensor counts (int64), then the padded packed payloads
    for name in ("dgc_topk", "threshold"):
        assert [c[:2] for c in calls[name]] == [("all_gather", torch.int64), ("all_gather", torch.uint8)]
        assert calls[name][0][2] == 6
    # scalable: one all-to-all of the packed chunks, one all-gather of the recompressed chunk;
    # at W = 2 the same bytes in one all-gather of the packed payloads (int8: a byte per
    # element and an fp32 min and max per 256-element chunk of each layer)
    for name in ("sign", "int8", "int4", "qsgd", "terngrad"):
        if w == 2:
            assert [c[:2] for c in calls[name]] == [("all_gather", torch.uint8)], name
        else:
            assert [c[:2] for c in calls[name]] == [("all_to_all_single", torch.uint8), ("all_gather", torch.uint8)]
    if w == 2:
        assert calls["int8"][0][2] == sum(n + 8 * math.ceil(n / 256) for n in numels)
        # int4: two codes a byte (2112 / 2, 5000 / 2, 1152 / 2), the same bounds
        assert calls["int4"][0][2] == (1056 + 2500 + 576) + 8 * (9 + 20 + 5)


def test_single_process_group_is_local_compression():
    # no process group at all: a plain local round trip, nothing on the wire
    xs = _inputs(0)
    comps = [make_compressor("topk", ratio=0.1) for _ in xs]
    res, overhead = sparse_allgather(xs, comps, Group()).wait()
    for r in res:
        assert r.wire_bytes == 0
        torch.testing.assert_close(r.mean, r.sent)
    assert overhead == 0


def _mixed_bucket(rank: int, world_size: int) -> tuple[list[bool], torch.Tensor, torch.Tensor]:
    # a DDP bucket's layout: small dense layers between two large ones cast to bf16
    gen = torch.Generator().manual_seed(rank)
    bucket = torch.randn(64 + 2048 + 64 + 1500, generator=gen)
    original = bucket.clone()
    b1, w1, b2, w2 = bucket.split([64, 2048, 64, 1500])
    group = Group()
    cast = summable_allreduce([w1, w2], [make_compressor("bf16"), make_compressor("bf16")], group,
                              keep_sent=False, in_place=True)
    dense = dense_allreduce([b1, b2], group, in_place=True)
    means = [r.mean for r in cast.wait()] + [r.mean for r in dense.wait()]
    return [m.data_ptr() == t.data_ptr() for m, t in zip(means, [w1, w2, b1, b2], strict=True)], original, bucket


def test_means_land_in_the_inputs_when_they_may_be_overwritten():
    # the hook then hands the bucket back as it is: no copy of the whole bucket
    per_rank = run_distributed(_mixed_bucket, 2)
    sent = [original for _, original, _ in per_rank]
    for where, _, bucket in per_rank:
        assert where == [True, True, True, True]  # every mean is the input it replaces
        for lo, hi in ((0, 64), (2112, 2176)):  # dense: the exact mean
            torch.testing.assert_close(bucket[lo:hi], (sent[0][lo:hi] + sent[1][lo:hi]) / 2)
        for lo, hi in ((64, 2112), (2176, 3676)):  # each rank's half rounded to bf16, summed in bf16
            halves = [(x[lo:hi] / 2).to(torch.bfloat16) for x in sent]
            torch.testing.assert_close(bucket[lo:hi], (halves[0] + halves[1]).float())


def _fails_or_dies(rank: int, world_size: int, how: str) -> int:
    if rank == 1 and how == "raise":
        raise RuntimeError("rank 1 broke")
    if how == "die":
        import torch.distributed as dist

        dist.barrier()  # both ranks past the handshake: dying inside it fails rank 0's first
        if rank == 1:
            import os

            os._exit(3)  # no result, no traceback: what a crashed rank leaves
    return rank


@pytest.mark.parametrize(("how", "message"), [
    ("raise", r"(?s)rank 1:\n.*RuntimeError: rank 1 broke"),
    ("die", r"rank 1: exited with code 3 without a result"),
])
def test_the_gloo_runner_fails_on_a_rank_that_raises_or_dies_without_waiting_out_its_timeout(how, message):
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError, match=message):
        run_distributed(_fails_or_dies, 2, how, timeout=120)
    assert time.monotonic() - started < 60
    assert run_distributed(_fails_or_dies, 2, "none") == [0, 1]
