"""What really travels: every registered compressor, through the reducer and the DDP hook,
on real gloo processes, with every collective call recorded (``tests.support.wire``).

The expected tensors are derived from each compressor's documented wire format and the
layer shapes (never from the ledger or ``Payload.nbytes``); the bytes each call transmits
come from the recorder's per-collective traffic model, which knows nothing of compressors.
Gloo's flight recorder cross-checks that no collective escaped the recorder.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp.compressors import COMPRESSORS, Transport
from tests.distributed import run_distributed
from tests.support.wire import FLIGHT_RECORDER_ENV, Call, WireRecorder, transmitted_bytes

F32, F16, BF16, U8, I32, I64 = torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int32, torch.int64
U16 = torch.uint16

# the parameters each registered compressor runs with here
SPECS: dict[str, dict] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "randomk": {"ratio": 0.05},
    "topk": {"ratio": 0.02},
    "dgc_topk": {"ratio": 0.02},
    "threshold": {"threshold": 2.0},
    "qsgd": {"points": 7, "bucket_size": 512},
    "terngrad": {},
    "sign": {},
    "int8": {"chunk_size": 256},
    "int4": {"chunk_size": 256},
    "powersgd": {"rank": 2},
    "sparseloco": {"ratio": 0.05, "chunk_size": 256},
}
MIN_COMPRESS_NUMEL = 1024
# reducer path: two matrices, a vector that only PowerSGD sends dense, a tiny dense bias
LAYERS = [("w1", (96, 40)), ("b1", (40,)), ("w2", (64, 32)), ("v", (1500,))]
REDUCER_STEPS = 2
HOOK_STEPS = 3  # DDP rebuilds its buckets after the first step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 96), nn.ReLU(), nn.Linear(96, 32), nn.ReLU(), nn.Linear(32, 10))


# --- the documented wire formats (from each compressor's docstring) ----------------------
def _qsgd_bits(points: int) -> int:
    return next(b for b in (2, 4, 8) if 2 * points + 1 <= 2**b)  # "smallest that holds 2s+1 codes"


def _chunked_kept(params: dict, n: int) -> int:
    """SparseLoCo's kept values: ``max(1, ceil(ratio * chunk))`` per chunk, the last by its own length."""
    size = params["chunk_size"]
    return sum(max(1, math.ceil(params["ratio"] * min(size, n - start))) for start in range(0, n, size))


def wire_format(name: str, params: dict, shape: Sequence[int], kept: int | None = None) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of each tensor one payload of a tensor of ``shape`` puts on the wire.

    ``kept``: the number of elements a sparsifier kept (Top-K variants, threshold).
    """
    n = math.prod(shape)
    if name == "none":
        return [(F32, n)]
    if name in ("fp16", "bf16"):
        return [(F16 if name == "fp16" else BF16, n)]
    if name == "randomk":  # values only; indices are regenerated from the shared seed
        return [(F32, math.ceil(params["ratio"] * n))]
    if name in ("topk", "dgc_topk", "threshold"):  # values + int32 flat indices
        assert kept is not None
        return [(F32, kept), (I32, kept)]
    if name == "sign":  # ceil(N / 8) bytes + one fp32 scale
        return [(U8, math.ceil(n / 8)), (F32, 1)]
    if name == "terngrad":  # ceil(N / 4) bytes + one fp32 scale
        return [(U8, math.ceil(n / 4)), (F32, 1)]
    if name == "qsgd":  # ceil(N * bits / 8) bytes + one fp32 norm per bucket
        return [(U8, math.ceil(n * _qsgd_bits(params["points"]) / 8)), (F32, math.ceil(n / params["bucket_size"]))]
    if name == "int8":  # N bytes + (min, max) fp32 per chunk
        return [(U8, n), (F32, 2 * math.ceil(n / params["chunk_size"]))]
    if name == "int4":  # ceil(N / 2) bytes + (min, max) fp32 per chunk
        return [(U8, math.ceil(n / 2)), (F32, 2 * math.ceil(n / params["chunk_size"]))]
    if name == "sparseloco":  # uint16 positions in the chunk, 2-bit codes, two fp32 magnitudes per chunk
        k = _chunked_kept(params, n)
        return [(U16, k), (U8, math.ceil(k / 4)), (F32, 2 * math.ceil(n / params["chunk_size"]))]
    if name == "powersgd":  # P (rows x r) and Q (cols x r), fp32
        rows, cols = shape[0], n // shape[0]
        r = min(params["rank"], rows, cols)
        return [(F32, rows * r), (F32, cols * r)]
    raise AssertionError(f"no documented wire format for {name!r} in this test")


def _bytes(tensors: list[tuple[torch.dtype, int]]) -> int:
    return sum(torch.empty((), dtype=d).element_size() * k for d, k in tensors)


def test_wire_formats_hand_computed():
    # a few concrete shapes worked out by hand from the docstrings
    assert _bytes(wire_format("sign", {}, (96, 40))) == 480 + 4
    assert _bytes(wire_format("terngrad", {}, (1500,))) == 375 + 4
    assert _bytes(wire_format("qsgd", SPECS["qsgd"], (1500,))) == 750 + 3 * 4  # 4 bits, 3 buckets
    assert _bytes(wire_format("int8", SPECS["int8"], (64, 32))) == 2048 + 8 * 8
    assert _bytes(wire_format("int4", SPECS["int4"], (1500,))) == 750 + 6 * 8  # 2 codes a byte, 6 chunks
    assert _bytes(wire_format("topk", SPECS["topk"], (96, 40), kept=77)) == 77 * 8  # ceil(76.8)
    assert _bytes(wire_format("randomk", SPECS["randomk"], (1500,))) == 75 * 4
    assert _bytes(wire_format("powersgd", SPECS["powersgd"], (96, 40))) == (96 + 40) * 2 * 4
    assert _bytes(wire_format("fp16", {}, (40,))) == 80
    # 3840 = 15 chunks of 256, 13 kept each (ceil(12.8)): 195 x 2 + 49 + 15 x 8
    assert _bytes(wire_format("sparseloco", SPECS["sparseloco"], (96, 40))) == 390 + 49 + 120
    # 1500 = 5 x 256 + 220: 5 x 13 + 11 kept, 6 chunks
    assert _bytes(wire_format("sparseloco", SPECS["sparseloco"], (1500,))) == 76 * 2 + 19 + 6 * 8


def test_every_registered_compressor_is_covered():
    assert set(SPECS) == set(COMPRESSORS)


# --- what the collectives must carry -----------------------------------------------------
def _route(name: str, params: dict, shape: Sequence[int]) -> Transport:
    """The documented routing: tiny layers and shapes a compressor refuses go dense."""
    n = math.prod(shape)
    if n < MIN_COMPRESS_NUMEL:
        return Transport.DENSE
    if name == "powersgd":  # vectors, and matrices whose factors are not smaller, go dense
        if len(shape) < 2:
            return Transport.DENSE
        fmt = wire_format(name, params, shape)
        if fmt[0][1] + fmt[1][1] >= n:
            return Transport.DENSE
    return COMPRESSORS[name].transport


def _chunk_sizes(n: int, w: int) -> list[int]:
    base, extra = divmod(n, w)
    return [base + (1 if j < extra else 0) for j in range(w)]


Signature = tuple[str, torch.dtype, int, tuple[int, ...] | None]


def _signature(call: Call) -> Signature:
    # which API variant carries the bytes does not matter here, only the traffic
    kind = {"all_gather_into_tensor": "all_gather", "all_to_all_single": "all_to_all"}.get(call.op, call.op)
    splits = call.splits if kind == "all_to_all" else None
    return kind, call.dtype, call.numel, splits


def expected_calls(
    name: str, layers: Sequence[tuple[str, Sequence[int]]], w: int, me: int, kept: dict[str, list[int]]
) -> Counter[Signature]:
    """The collectives one reduction must issue on rank ``me``, from the wire formats.

    ``kept[layer][rank]``: elements each rank's sparsifier kept (sparse layers only).
    """
    params = SPECS[name]
    routes: dict[Transport, list[tuple[str, Sequence[int]]]] = {}
    for layer, shape in layers:
        routes.setdefault(_route(name, params, shape), []).append((layer, shape))
    calls: Counter[Signature] = Counter()
    if w == 1:
        return calls
    for transport, members in routes.items():
        if transport is Transport.DENSE:
            calls["all_reduce", F32, sum(math.prod(s) for _, s in members), None] += 1
        elif transport is Transport.ALLREDUCE:  # one all-reduce per payload dtype
            by_dtype: Counter[torch.dtype] = Counter()
            for _, shape in members:
                for dtype, k in wire_format(name, params, shape):
                    by_dtype[dtype] += k
            for dtype, k in by_dtype.items():
                calls["all_reduce", dtype, k, None] += 1
        elif transport is Transport.LOWRANK:  # all P in one all-reduce, then all Q
            fmts = [wire_format(name, params, shape) for _, shape in members]
            calls["all_reduce", F32, sum(f[0][1] for f in fmts), None] += 1
            calls["all_reduce", F32, sum(f[1][1] for f in fmts), None] += 1
        elif transport is Transport.ALLGATHER:  # packed bytes of every rank, padded to the largest
            per_rank = [
                sum(_bytes(wire_format(name, params, shape, kept[layer][r])) for layer, shape in members)
                for r in range(w)
            ]
            if COMPRESSORS[name].variable_size:  # element counts of every payload tensor first
                calls["all_gather", I64, 2 * len(members), None] += 1
            calls["all_gather", U8, max(1, max(per_rank)), None] += 1
        elif transport is Transport.SCALABLE and w == 2:  # the same bytes in one all-gather
            calls["all_gather", U8, sum(_bytes(wire_format(name, params, shape)) for _, shape in members), None] += 1
        elif transport is Transport.SCALABLE:  # chunk j of every layer to rank j, then all-gather
            splits = [0] * w
            for _, shape in members:
                for j, c in enumerate(_chunk_sizes(math.prod(shape), w)):
                    splits[j] += _bytes(wire_format(name, params, (c,)))
            calls["all_to_all", U8, sum(splits), tuple(splits)] += 1
            calls["all_gather", U8, max(splits), None] += 1
    return calls


def test_expected_calls_hand_computed():
    # Top-K 2% on w1 (77 kept) and w2 (41 kept) at W=2, b1 and v on their routes
    kept = {"w1": [77, 77], "w2": [41, 41], "v": [30, 30]}
    calls = expected_calls("topk", LAYERS, 2, 0, kept)
    assert calls == Counter({("all_gather", U8, (77 + 41 + 30) * 8, None): 1, ("all_reduce", F32, 40, None): 1})
    # sign at W=2, one all-gather: w1 3840 (480 B + a 4-byte scale), w2 2048 (256 + 4), v 1500 (188 + 4)
    calls = expected_calls("sign", LAYERS, 2, 1, {})
    assert calls[("all_gather", U8, 484 + 260 + 192, None)] == 1
    assert not any(op == "all_to_all" for op, *_ in calls)
    # at W=4, two rounds: w1 -> four chunks of 960 (120 + 4), w2 -> 512 (64 + 4), v -> 375 (47 + 4)
    calls = expected_calls("sign", LAYERS, 4, 1, {})
    split = 124 + 68 + 51
    assert calls[("all_to_all", U8, 4 * split, (split,) * 4)] == 1
    assert calls[("all_gather", U8, split, None)] == 1
    # PowerSGD rank 2: P = (96 + 64) x 2, Q = (40 + 32) x 2; v goes dense with b1
    calls = expected_calls("powersgd", LAYERS, 2, 0, {})
    assert calls == Counter({("all_reduce", F32, 320, None): 1, ("all_reduce", F32, 144, None): 1,
                             ("all_reduce", F32, 1540, None): 1})


# --- the workers ---------------------------------------------------------------------------
def _residuals(state: CompressedReducer, names: Sequence[str]) -> dict[str, torch.Tensor | None]:
    return {n: None if state.memory.residual(n) is None else state.memory.residual(n).clone() for n in names}


def _sent(compensated: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """What this rank sent: residual memory keeps ``compensated - sent``."""
    return compensated if residual is None else compensated - residual


def _replica(state: CompressedReducer, name: str):
    """A copy of the layer's compressor as it stands now (same seed, same draws so far)."""
    replica = state.plan.spec_for(name).build(name, state.group.rank, state.router.seed)
    if name in state.router.compressors:
        replica.load_state_dict(state.router.compressors[name][1].state_dict())
    return replica


def _replayed_sent(replica, transport: Transport, compensated: torch.Tensor, w: int) -> torch.Tensor:
    """What a compressor without error feedback sent: no residual records it, so replay the
    rank's own compression on a replica (the transports' documented chunking)."""
    if transport is Transport.SCALABLE:  # W near-equal chunks, the larger ones first (W = 2: one)
        chunks = torch.tensor_split(compensated.reshape(-1), w if w > 2 else 1)
        return torch.cat([replica.decompress(replica.compress(c)).reshape(-1) for c in chunks]).view_as(compensated)
    assert transport is Transport.ALLREDUCE, transport  # divided by W before compression
    return replica.decompress(replica.compress(compensated / w)) * w


def _record_step(recorder: WireRecorder, state: CompressedReducer, names, grads, run) -> dict:
    """Run one reduction (``run()``) with the recorder on; what it sent, cost and carried."""
    before = _residuals(state, names)
    compensated = [g if before[n] is None else g + before[n] for n, g in zip(names, grads, strict=True)]
    replay = {}
    for n, g in zip(names, grads, strict=True):
        replica, transport = _replica(state, n), state.transport_for(n, g.shape)
        if transport is not Transport.DENSE and replica.lossy and not replica.error_feedback:
            replay[n] = (replica, transport)
    mark, ledger = recorder.mark(), state.ledger.wire_total
    means = run()
    after = _residuals(state, names)
    return {
        "calls": recorder.since(mark),
        "ledger": state.ledger.wire_total - ledger,
        "compensated": dict(zip(names, compensated, strict=True)),
        "sent": {n: _replayed_sent(*replay[n], c, state.group.size) if n in replay else _sent(c, after[n])
                 for n, c in zip(names, compensated, strict=True)},
        "mean": dict(zip(names, means, strict=True)),
    }


def _reducer_runs(rank: int, w: int) -> dict:
    names = [n for n, _ in LAYERS]
    out = {}
    for name, params in SPECS.items():
        reducer = CompressedReducer(Plan.uniform(name, **params), min_compress_numel=MIN_COMPRESS_NUMEL)
        steps = []
        with WireRecorder() as recorder:
            for step in range(REDUCER_STEPS):
                gen = torch.Generator().manual_seed(100 * rank + step)
                grads = [torch.randn(shape, generator=gen) for _, shape in LAYERS]

                def run(grads=grads, reducer=reducer):
                    means = reducer.reduce(names, grads)
                    reducer.end_step()
                    return means

                steps.append(_record_step(recorder, reducer, names, grads, run))
            unrecorded = recorder.unrecorded()
        out[name] = {"steps": steps, "unrecorded": unrecorded, "layers": LAYERS}
    return out


def _hook_runs(rank: int, w: int) -> dict:
    out = {}
    for name, params in SPECS.items():
        ddp = DDP(_model(), bucket_cap_mb=25)  # one bucket: a step is one reduction
        replica = _model()  # the same weights without DDP: the gradient the hook receives
        state = CompressionState(ddp, Plan.uniform(name, **params), min_compress_numel=MIN_COMPRESS_NUMEL)
        ddp.register_comm_hook(state, compression_hook)
        names = [n for n, _ in replica.named_parameters()]
        steps = []
        with WireRecorder() as recorder:
            for step in range(HOOK_STEPS):
                gen = torch.Generator().manual_seed(1000 * rank + step)
                x = torch.randn(16, 40, generator=gen)
                replica.zero_grad()
                replica(x).square().mean().backward()
                grads = [p.grad.clone() for p in replica.parameters()]

                def run(x=x, ddp=ddp):
                    ddp.zero_grad()
                    ddp(x).square().mean().backward()
                    return [p.grad.clone() for p in ddp.parameters()]

                steps.append(_record_step(recorder, state.reducer, names, grads, run))
            unrecorded = recorder.unrecorded()
        state.close()
        layers = [(n, tuple(p.shape)) for n, p in replica.named_parameters()]
        out[name] = {"steps": steps, "unrecorded": unrecorded, "layers": layers}
    return out


def _recorder_self_check(rank: int, w: int) -> dict:
    """Known collectives through the recorder, and the module restored afterwards."""
    original = dist.all_reduce
    with WireRecorder() as recorder:
        dist.all_reduce(torch.ones(10))  # 40 B
        out = [torch.empty(3, dtype=torch.float64) for _ in range(w)]
        dist.all_gather(out, torch.ones(3, dtype=torch.float64))  # 24 B
        sizes = [j + 1 for j in range(w)]  # rank r sends j + 1 rows of 2 int32 to rank j
        dist.all_to_all_single(
            torch.empty(w * (rank + 1), 2, dtype=torch.int32),
            torch.zeros(sum(sizes), 2, dtype=torch.int32),
            output_split_sizes=[rank + 1] * w,
            input_split_sizes=sizes,
        )
        dist.broadcast(torch.ones(5), src=1)  # 20 B from rank 1
        patched = dist.all_reduce is not original
    return {
        "transmitted": [c.transmitted for c in recorder.calls],
        "unrecorded": recorder.unrecorded(),
        "patched": patched,
        "restored": dist.all_reduce is original,
    }


HOOK_WORLD_SIZES = (2,)  # DDP's first construction costs seconds per process: W=2 only


def _everything(rank: int, w: int) -> dict:
    return {
        "self_check": _recorder_self_check(rank, w),
        "reducer": _reducer_runs(rank, w),
        "hook": _hook_runs(rank, w) if w in HOOK_WORLD_SIZES else None,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def results(request):
    w = request.param
    return w, run_distributed(_everything, w, env_per_rank=lambda r: FLIGHT_RECORDER_ENV, timeout=300)


def _paths(per_rank) -> list[str]:
    """The paths that ran at this world size (the hook: at HOOK_WORLD_SIZES)."""
    return [p for p in ("reducer", "hook") if per_rank[0][p] is not None]


# --- the recorder itself -------------------------------------------------------------------
def test_recorder_applies_the_traffic_model_per_collective(results):
    w, per_rank = results
    for rank, res in enumerate(per_rank):
        check = res["self_check"]
        assert check["patched"] and check["restored"]
        assert check["unrecorded"] == []
        to_others = sum(j + 1 for j in range(w) if j != rank) * 2 * 4
        assert check["transmitted"] == pytest.approx(
            [2 * (w - 1) / w * 40, (w - 1) * 24, to_others, (w - 1) * 20 if rank == 1 else 0]
        )


# --- the claims, for every compressor, through the reducer and the hook -------------------


def _kept(steps_per_rank: list[dict], layers) -> dict[str, list[int]]:
    """Elements each rank's sparsifier delivered: the nonzeros of what it sent."""
    return {n: [int(torch.count_nonzero(s["sent"][n])) for s in steps_per_rank] for n, _ in layers}


def _steps(per_rank, path, name):
    """[(step, [rank's record of that step for every rank])]."""
    n = len(per_rank[0][path][name]["steps"])
    return [(i, [r[path][name]["steps"][i] for r in per_rank]) for i in range(n)]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tensors_on_the_wire_follow_the_documented_format(results, name):
    w, per_rank = results
    for path in _paths(per_rank):
        layers = per_rank[0][path][name]["layers"]
        for step, records in _steps(per_rank, path, name):
            kept = _kept(records, layers)
            for layer, shape in layers:
                if _route(name, SPECS[name], shape) is not Transport.ALLGATHER:
                    continue
                k = math.ceil(SPECS[name].get("ratio", 1) * math.prod(shape))
                for r, count in enumerate(kept[layer]):
                    if name == "topk":
                        assert count == k, (path, layer, r)
                    elif name == "dgc_topk":  # within [(1 - tolerance) k, k], tolerance 0.1
                        assert 0.9 * k <= count <= k, (path, layer, r, count, k)
                    elif name == "sparseloco":  # per chunk, not of the whole layer
                        assert count == _chunked_kept(SPECS[name], math.prod(shape)), (path, layer, r)
                    else:  # threshold: every element at or above it, and no other
                        compensated = records[r]["compensated"][layer]
                        assert count == int((compensated.abs() >= SPECS[name]["threshold"]).sum()), (path, layer, r)
            for me, record in enumerate(records):
                got = Counter(_signature(c) for c in record["calls"])
                assert got == expected_calls(name, layers, w, me, kept), (path, step, me)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recorded_bytes_equal_the_ledger(results, name):
    _, per_rank = results
    for path in _paths(per_rank):
        for step, records in _steps(per_rank, path, name):
            for me, record in enumerate(records):
                recorded = sum(transmitted_bytes(c) for c in record["calls"])
                assert recorded > 0
                assert record["ledger"] == pytest.approx(recorded, rel=1e-12), (path, step, me)


@pytest.mark.parametrize("name", sorted(set(SPECS) - {"none"}))
def test_no_dense_sized_tensor_travels_for_a_compressed_layer(results, name):
    _, per_rank = results
    for path in _paths(per_rank):
        layers = per_rank[0][path][name]["layers"]
        dense_numel = sum(math.prod(s) for _, s in layers if _route(name, SPECS[name], s) is Transport.DENSE)
        compressed_bytes = sum(4 * math.prod(s) for _, s in layers if _route(name, SPECS[name], s) is not Transport.DENSE)
        assert compressed_bytes > 0
        for _, records in _steps(per_rank, path, name):
            for record in records:
                for call in record["calls"]:
                    if (call.op, call.dtype, call.numel) == ("all_reduce", F32, dense_numel):
                        continue  # the layers that go dense
                    # half precision halves; every other format is far smaller still
                    limit = compressed_bytes / 2 if name in ("fp16", "bf16") else compressed_bytes / 3
                    assert call.nbytes <= limit, (path, call, compressed_bytes)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_collective_escaped_the_recorder(results, name):
    _, per_rank = results
    for path in _paths(per_rank):
        for rank in per_rank:
            missing = rank[path][name]["unrecorded"]
            if path == "hook":
                # DDP's own bucket rebuild after the first step broadcasts int32 bucket indices
                missing = [m for m in missing if m[0] != "gloo:broadcast" or m[2] != "Int"]
            assert missing == []


def _check_requantized_chunk(name: str, mean: torch.Tensor, avg: torch.Tensor) -> None:
    """The server's chunk is the documented compression of the average of the ranks' chunks."""
    if name == "sign":  # (||x||_1 / N) * sign(x)
        scale = avg.abs().mean()
        torch.testing.assert_close(mean, torch.where(avg >= 0, scale, -scale), rtol=1e-4, atol=1e-6)
    elif name in ("int8", "int4"):  # at most half a step of 1/255 (1/15) of the range
        steps = 255 if name == "int8" else 15
        assert float((mean - avg).abs().max()) <= float(avg.max() - avg.min()) / steps / 2 + 1e-6
    elif name == "terngrad":  # values in {-s, 0, s}, s = max |x|, never of the wrong sign
        s = avg.abs().max()
        assert bool(((mean == 0) | ((mean - s * avg.sign()).abs() <= 1e-6 * s)).all())
    elif name == "qsgd":  # within one point (norm / s) of the input, never of the wrong sign
        bound = float(torch.linalg.vector_norm(avg)) / SPECS["qsgd"]["points"]
        assert float((mean - avg).abs().max()) <= bound * (1 + 1e-5)
        assert bool(((mean == 0) | (mean.sign() == avg.sign())).all())
    else:
        raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_mean_is_the_mean_of_what_the_ranks_sent(results, name):
    w, per_rank = results
    for path in _paths(per_rank):
        layers = per_rank[0][path][name]["layers"]
        tol = {"fp16": 4e-3, "bf16": 3e-2}.get(name, 1e-5)
        for step, records in _steps(per_rank, path, name):
            for layer, shape in layers:
                for other in records[1:]:
                    assert torch.equal(records[0]["mean"][layer], other["mean"][layer]), (path, step, layer)
                mean = records[0]["mean"][layer].float()
                avg = sum(r["sent"][layer].float() for r in records) / w
                if _route(name, SPECS[name], shape) is Transport.SCALABLE and w > 2:
                    if step == 0:  # later steps add the server's error feedback
                        for m, a in zip(_chunks(mean, w), _chunks(avg, w), strict=True):
                            _check_requantized_chunk(name, m, a)
                else:
                    torch.testing.assert_close(mean, avg, rtol=tol, atol=tol, msg=f"{path} {name} {layer} step {step}")


def _chunks(t: torch.Tensor, w: int) -> list[torch.Tensor]:
    return list(t.reshape(-1).split(_chunk_sizes(t.numel(), w)))


# --- the guard's control values, carried in the step's last reduction ------------------
def _control_runs(rank: int, w: int) -> dict:
    out = {}
    for label, layers in (("with a dense layer", LAYERS), ("all compressed", [LAYERS[0], LAYERS[2]])):
        names = [n for n, _ in layers]
        reducer = CompressedReducer(Plan.uniform("topk", ratio=0.02), min_compress_numel=MIN_COMPRESS_NUMEL)
        steps = []
        with WireRecorder() as recorder:
            for step in range(2):
                reducer.stage_control([10.0 * rank + step, 1.0])
                gen = torch.Generator().manual_seed(100 * rank + step)
                grads = [torch.randn(shape, generator=gen) for _, shape in layers]
                mark, ledger = recorder.mark(), reducer.ledger.wire_total
                reducer.reduce(names, grads, closes_step=True)
                reducer.end_step()
                steps.append({"recorded": sum(transmitted_bytes(c) for c in recorder.since(mark)),
                              "ledger": reducer.ledger.wire_total - ledger,
                              "rows": reducer.control_rows.tolist()})
        out[label] = steps
    return out


def test_carried_control_values_reach_every_rank_and_are_charged_to_the_ledger():
    per_rank = run_distributed(_control_runs, 2)
    for label in per_rank[0]:
        for step in range(2):
            expected_rows = [[0.0, 10.0 * r + step, 1.0] for r in range(2)]  # [non-finite flag, values]
            for rank, runs in enumerate(per_rank):
                entry = runs[label][step]
                assert entry["rows"] == expected_rows, (label, step, rank)
                assert math.isclose(entry["recorded"], entry["ledger"], rel_tol=1e-12), (label, step, rank, entry)
