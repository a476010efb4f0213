"""The compressors, bit packing and payload packing on CUDA, against the same calls on the CPU."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from raycomp._internal.wire.bitpack import pack_bits, unpack_bits
from raycomp._internal.wire.payload import Payload, pack, unpack_like
from raycomp.compressors import COMPRESSORS
from tests.gpu.support import (
    CUDA,
    DTYPES,
    PARAMS,
    build,
    count_syncs,
    payload_tensors,
    randn,
    rel_err,
    sites,
)

pytestmark = pytest.mark.gpu

SHAPES = [(1000,), (64, 33), (8, 4, 3, 3), (257, 129)]
#: compressors whose output must equal the CPU's (up to rounding); the others draw random numbers
DETERMINISTIC = {"none", "fp16", "bf16", "topk", "threshold", "sign", "int8", "int4", "powersgd"}
#: the parameters of the speed measurement (docs/benchmarks' kernel table uses the same)
BENCH_PARAMS = {**PARAMS, "randomk": {"ratio": 0.01}, "threshold": {"threshold": 2.576},
                "powersgd": {"rank": 4}}
#: host syncs of one compress plus one decompress: data-dependent sizes need one; DGC's
#: one per sampling round, and a round whose sampled threshold keeps too few elements is
#: retried (up to max_retries, 3 by default: two rounds on some draws of the input)
SYNCS = {"randomk": 1, "threshold": 1, "dgc_topk": 4}


def test_bitpack_gives_the_cpu_bytes_on_cuda() -> None:
    for bits in (1, 2, 4, 8):
        for n in (1, 7, 8, 1001, 4096 + 3):
            codes = torch.randint(0, 2**bits, (n + 5,), generator=torch.Generator().manual_seed(n))
            codes = codes.to(torch.uint8)[5:]  # an offset view: exercises the alignment path
            cpu = pack_bits(codes, bits)
            dev = pack_bits(codes.to(CUDA), bits)
            assert dev.device == CUDA, f"pack_bits output on {dev.device}"
            assert torch.equal(cpu, dev.cpu()), f"bits={bits} n={n}: packed bytes differ from CPU"
            back = unpack_bits(dev, bits, n)
            assert back.device == CUDA and torch.equal(back.cpu(), codes), f"bits={bits} n={n}"


def test_payloads_pack_and_unpack_on_the_device() -> None:
    ps = [build(n).compress(randn((64, 33), 1, torch.float32).to(CUDA))
          for n in ("topk", "qsgd", "int8", "sign", "fp16")]
    buf = pack(ps)
    assert buf.device == CUDA, f"pack() buffer on {buf.device}"
    assert buf.numel() == sum(p.nbytes for p in ps)
    back = unpack_like(buf[: buf.numel()], ps)
    for a, b in zip(ps, back, strict=True):
        for k in a.tensors:
            assert b.tensors[k].device == CUDA and torch.equal(a.tensors[k], b.tensors[k]), k
    empty = Payload({"values": torch.empty(0, device=CUDA)}, torch.Size([0]), torch.float32)
    assert pack([empty]).device == CUDA, "pack of a zero-element payload left the device"


def _same_warm_start(name: str, shape: tuple[int, ...], cpu_c: Any, dev_c: Any) -> None:
    """PowerSGD's first Q drawn once for both (CPU and CUDA random streams differ)."""
    if name != "powersgd":
        return
    q = torch.randn(int(math.prod(shape[1:])), min(2, shape[0], math.prod(shape[1:])),
                    generator=torch.Generator().manual_seed(3))
    state = cpu_c.state_dict()
    cpu_c.load_state_dict({**state, "q": q})
    dev_c.load_state_dict({**state, "q": q.to(CUDA)})


def _compare_outputs(name: str, where: str, x: torch.Tensor, pc: Any, pd: Any, yc: torch.Tensor,
                     yd: torch.Tensor, worst: dict[str, float]) -> None:
    """A deterministic compressor's CUDA output against its CPU output."""
    dtype = x.dtype
    if name == "int8":  # rounding can differ by one code (FMA); bound by one step
        step = (x.float().abs().max() * 2 / 255).item()
        diff = (yc.float() - yd.float().cpu()).abs().max().item()
        tol = step + (1e-2 if dtype != torch.float32 else 1e-5) * x.float().abs().max().item()
        assert diff <= tol, f"{where}: int8 CPU/CUDA differ by {diff} > {tol}"
        worst[where] = diff
    elif name in ("powersgd", "sign"):
        e = rel_err(yc, yd)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert e <= tol, f"{where}: CPU/CUDA rel diff {e:.2e} > {tol}"
        worst[where] = e
    elif name == "topk":  # ties (common in bf16/fp16) may pick other elements
        kc = pc.tensors["values"].float().abs().sort().values
        kd = pd.tensors["values"].float().abs().sort().values.cpu()
        assert torch.equal(kc, kd), f"{where}: kept magnitudes differ from CPU"
        if not torch.equal(yc, yd.cpu()):
            worst[where + " (tie: other elements of equal magnitude)"] = rel_err(yc, yd)
    elif not torch.equal(yc, yd.cpu()):
        e = rel_err(yc, yd)
        worst[where] = e
        assert e < 1e-6, f"{where}: CPU/CUDA outputs differ (rel {e:.2e})"


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compressor_on_cuda_matches_the_cpu(name: str, note: Callable[[str], None]) -> None:
    """Every shape x dtype: payload and output on the device with the CPU's dtypes, shape and
    sizes; deterministic compressors give the CPU's output (within rounding), random ones
    an error as small as the CPU's and the same numbers again for the same seed."""
    worst: dict[str, float] = {}
    for shape in SHAPES:
        for dtype in DTYPES:
            if not build(name).accepts(torch.Size(shape)):
                continue
            x = randn(shape, seed=hash((shape, str(dtype))) % 1000, dtype=dtype)
            cpu_c, dev_c = build(name), build(name)
            _same_warm_start(name, shape, cpu_c, dev_c)
            pc = cpu_c.compress(x)
            pd = dev_c.compress(x.to(CUDA))
            where = f"{shape}/{str(dtype).removeprefix('torch.')}"
            for t in payload_tensors(pd):
                assert t.device == CUDA, f"{where}: payload tensor on {t.device}"
            assert pd.nbytes == sum(t.numel() * t.element_size() for t in pd.tensors.values())
            assert pd.nbytes == pc.nbytes or cpu_c.variable_size, (
                f"{where}: nbytes cuda {pd.nbytes} != cpu {pc.nbytes}")
            packed = pack([pd])
            assert packed.numel() == pd.nbytes and packed.device == CUDA, f"{where}: pack"
            for k in pd.tensors:
                assert pd.tensors[k].dtype == pc.tensors[k].dtype, f"{where}: wire dtype of {k}"
            yc, yd = cpu_c.decompress(pc), dev_c.decompress(pd)
            assert yd.device == CUDA and yd.dtype == dtype and tuple(yd.shape) == shape, (
                f"{where}: out {yd.device} {yd.dtype} {tuple(yd.shape)}")
            assert torch.isfinite(yd.float()).all(), f"{where}: non-finite output"
            if name in DETERMINISTIC:
                _compare_outputs(name, where, x, pc, pd, yc, yd, worst)
            else:
                ec, ed = rel_err(x, yc), rel_err(x, yd)
                assert ed <= ec * 1.15 + 0.02, f"{where}: CUDA error {ed:.3f} vs CPU {ec:.3f}"
                # the same seed must give the same numbers on the same device (shared randomness)
                again = build(name).compress(x.to(CUDA))
                assert all(torch.equal(a, b) for a, b in zip(payload_tensors(pd), payload_tensors(again),
                                                               strict=True)), f"{where}: CUDA not reproducible"
    if worst:
        k = max(worst, key=lambda key: worst[key])
        note(f"max CPU/CUDA diff {worst[k]:.2e} at {k}")


def _copies(fn: Callable[[], Any]) -> dict[str, int]:
    """Host/device copies and host reads made by ``fn`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts = {"HtoD": 0, "DtoH": 0, "local_scalar": 0, "nonzero": 0}
    for ev in prof.events():
        if "Memcpy HtoD" in ev.name:
            counts["HtoD"] += 1
        elif "Memcpy DtoH" in ev.name:
            counts["DtoH"] += 1
        elif ev.name == "aten::_local_scalar_dense":
            counts["local_scalar"] += 1
        elif ev.name == "aten::nonzero":
            counts["nonzero"] += 1
    return counts


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compressor_host_syncs_and_speed(name: str, note: Callable[[str], None]) -> None:
    """Host syncs of a compress and a decompress of 1M elements (none, except where the
    payload's size depends on the values), and the time of each on 16M elements."""
    x1 = torch.randn(1024, 1024, device=CUDA)
    c = build(name, BENCH_PARAMS[name])
    for _ in range(3):
        c.decompress(c.compress(x1))
    syncs_c, msgs = count_syncs(lambda: c.compress(x1))
    p = c.compress(x1)
    syncs_d, msgs2 = count_syncs(lambda: c.decompress(p))
    copies = _copies(lambda: c.decompress(c.compress(x1)))
    x = torch.randn(1024, (1 << 24) // 1024, device=CUDA)
    c = build(name, BENCH_PARAMS[name])
    c.decompress(c.compress(x))
    times_c, times_d = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = c.compress(x)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        c.decompress(p)
        torch.cuda.synchronize()
        times_c.append(t1 - t0)
        times_d.append(time.perf_counter() - t1)
    mc, md = statistics.median(times_c), statistics.median(times_d)
    note(f"syncs compress/decompress {syncs_c}/{syncs_d} [{sites(msgs + msgs2)}], copies {copies}; "
         f"16M: compress {mc * 1e3:.3f} ms ({x.numel() * 4 / mc / 1e9:.1f} GB/s), decompress {md * 1e3:.3f} ms")
    assert syncs_c + syncs_d <= SYNCS.get(name, 0), f"{syncs_c}+{syncs_d} host syncs [{sites(msgs + msgs2)}]"


#: the KJV transformer's parameter shapes, roughly: many small layers and a few large ones
MANY_SHAPES = [(63, 128), (128,), (128,), (384, 128), (384,), (128, 128), (128,), (128,), (128,),
               (512, 128), (512,), (128, 512), (128,)] * 4 + [(63,), (7,), (2049,)]


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_layers_quantized_together_on_cuda_equal_one_at_a_time(name: str, note: Callable[[str], None]) -> None:
    """``compress_many`` / ``decompress_many`` on CUDA (all layers in one pass): the bytes
    and values of one layer at a time, no host sync, and the kernels and time it saves."""
    c = build(name)
    tensors = [randn(shape, i, DTYPES[i % 3]).to(CUDA) for i, shape in enumerate(MANY_SHAPES)]
    together, alone = c.compress_many(tensors), [c.compress(t) for t in tensors]
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        for key in b.tensors:
            assert torch.equal(a.tensors[key], b.tensors[key]), f"layer {i} {MANY_SHAPES[i]}: {key} differ"
    for i, (a, b) in enumerate(zip(c.decompress_many(alone), [c.decompress(p) for p in alone], strict=True)):
        assert a.device == CUDA and a.dtype == b.dtype and torch.equal(a, b), f"layer {i}: values differ"
    syncs, msgs = count_syncs(lambda: c.decompress_many(c.compress_many(tensors)))
    assert syncs == 0, f"{syncs} host syncs [{sites(msgs)}]"
    kernels = {way: _kernels(fn) for way, fn in (
        ("together", lambda: c.decompress_many(c.compress_many(tensors))),
        ("alone", lambda: [c.decompress(c.compress(t)) for t in tensors]))}
    times = {way: _median_ms(fn) for way, fn in (
        ("together", lambda: c.decompress_many(c.compress_many(tensors))),
        ("alone", lambda: [c.decompress(c.compress(t)) for t in tensors]))}
    note(f"{len(tensors)} layers: kernels together {kernels['together']}, alone {kernels['alone']}; "
         f"compress + decompress {times['together']:.2f} ms together, {times['alone']:.2f} ms alone")
    assert kernels["together"] * 5 < kernels["alone"], kernels


def _kernels(fn: Callable[[], Any]) -> int:
    """CUDA kernels ``fn`` launched (the profiler's kernel events)."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)


def _median_ms(fn: Callable[[], Any], runs: int = 20) -> float:
    fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
