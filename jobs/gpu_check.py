"""GPU checks for the compressors, the reducer, the DDP hook and a short training run.

Run on a machine with a CUDA device (no Ray, no pydantic needed)::

    PYTHONUNBUFFERED=1 python -m jobs.gpu_check --out $OUT

It prints a PASS/FAIL table and writes ``results.json`` (and the same table) under
``--out``. Also covered: the guard's control rows riding in the last reduction, the DDP
hook while the plan walks the adaptive policy's ladder (PowerSGD/Top-K, int4, int8, bf16,
dense), DDP with ``raycomp.bucket_cap_mb``'s buckets and the hook's threads, the hook on the
caller's own CUDA stream, and the FSDP2 path (``raycomp.sharded``, ``ShardedState``); a
check this torch cannot run is SKIP with the reason. ``--device cpu --quick`` runs the same logic on CPU with gloo (to check the
script itself; sync counts and CUDA timings are then skipped). Findings are written up in
``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raycomp.bitpack import pack_bits, unpack_bits
from raycomp.compressors import COMPRESSORS
from raycomp.payload import Payload, pack, unpack_like
from raycomp.plan import DENSE, CompressorSpec, Plan

PARAMS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"ratio": 0.01},
    "dgc_topk": {"ratio": 0.01},
    "randomk": {"ratio": 0.1},
    "threshold": {"threshold": 1.0},
    "qsgd": {"levels": 7, "bucket_size": 512},
    "terngrad": {},
    "sign": {},
    "int8": {"chunk_size": 2048},
    "int4": {"chunk_size": 2048},
    "powersgd": {"rank": 2},
}
BENCH_PARAMS = {**PARAMS, "randomk": {"ratio": 0.01}, "threshold": {"threshold": 2.576},
                "powersgd": {"rank": 4}}
DETERMINISTIC = {"none", "fp16", "bf16", "topk", "threshold", "sign", "int8", "int4", "powersgd"}
SHAPES = [(1000,), (64, 33), (8, 4, 3, 3), (257, 129)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

RESULTS: list[dict[str, Any]] = []


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """A check that cannot run here (an API this torch lacks, say): SKIP with the reason, not FAIL."""


def record(check: str, ok: bool, note: str = "", status: str = "") -> None:
    status = status or ("PASS" if ok else "FAIL")
    RESULTS.append({"check": check, "ok": bool(ok), "status": status, "note": note})
    print(f"[{status}] {check}{': ' + note if note else ''}", flush=True)
    if _SINK:  # a gloo worker: keep what is done even if the process dies later
        with open(_SINK[0], "w") as f:
            json.dump(RESULTS, f)


def skip(check: str, reason: str) -> None:
    record(check, True, reason, status="SKIP")


def guarded(check: str, fn: Callable[[], str | None]) -> None:
    try:
        note = fn()
        record(check, True, note or "")
    except Skip as reason:
        skip(check, str(reason))
    except Exception as error:  # noqa: BLE001 - every failure is a finding
        tb = traceback.format_exc(limit=6)
        print(tb, flush=True)
        record(check, False, f"{type(error).__name__}: {str(error)[:400]}")


def build(name: str, params: dict[str, Any] | None = None, layer: str = "layer"):
    return CompressorSpec.of(name, **(PARAMS[name] if params is None else params)).build(layer, 0)


def randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().cpu(), y.double().cpu()
    return float(torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(x).clamp_min(1e-30))


def same_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    """Whether every rank holds these tensors bit for bit (flattened and all-gathered)."""
    world = dist.get_world_size()
    if world == 1:
        return True
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors]).contiguous()
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], t) for t in gathered)


def payload_tensors(p: Payload) -> list[torch.Tensor]:
    return list(p.tensors.values()) + [v for v in p.meta.values() if isinstance(v, torch.Tensor)]


# --- 1. compressors ------------------------------------------------------------------------


def check_bitpack(device: torch.device) -> str:
    notes = []
    for bits in (1, 2, 4, 8):
        for n in (1, 7, 8, 1001, 4096 + 3):
            codes = torch.randint(0, 2**bits, (n + 5,), generator=torch.Generator().manual_seed(n))
            codes = codes.to(torch.uint8)[5:]  # an offset view: exercises the alignment path
            cpu = pack_bits(codes, bits)
            dev = pack_bits(codes.to(device), bits)
            assert dev.device == device, f"pack_bits output on {dev.device}"
            assert torch.equal(cpu, dev.cpu()), f"bits={bits} n={n}: packed bytes differ from CPU"
            back = unpack_bits(dev, bits, n)
            assert back.device == device and torch.equal(back.cpu(), codes), f"bits={bits} n={n}"
    notes.append("bytes identical to CPU for 1/2/4/8 bits")
    return "; ".join(notes)


def check_payload_pack(device: torch.device) -> str:
    ps = [build(n).compress(randn((64, 33), 1, torch.float32).to(device))
          for n in ("topk", "qsgd", "int8", "sign", "fp16")]
    buf = pack(ps)
    assert buf.device == device, f"pack() buffer on {buf.device}"
    assert buf.numel() == sum(p.nbytes for p in ps)
    back = unpack_like(buf[: buf.numel()], ps)
    for a, b in zip(ps, back, strict=True):
        for k in a.tensors:
            assert b.tensors[k].device == device and torch.equal(a.tensors[k], b.tensors[k]), k
    empty = Payload({"values": torch.empty(0, device=device)}, torch.Size([0]), torch.float32)
    e = pack([empty])
    return f"pack of zero-element payload -> device {e.device} ({'OK' if e.device == device else 'MISMATCH'})"


def check_compressor(name: str, device: torch.device, info: dict[str, Any]) -> str:
    notes: list[str] = []
    worst: dict[str, float] = {}
    for shape in SHAPES:
        for dtype in DTYPES:
            probe = build(name)
            if not probe.accepts(torch.Size(shape)):
                continue
            x = randn(shape, seed=hash((shape, str(dtype))) % 1000, dtype=dtype)
            cpu_c, dev_c = build(name), build(name)
            if name == "powersgd":  # same warm start on both: otherwise CPU/CUDA RNG differ
                q = torch.randn(int(math.prod(shape[1:])), min(2, shape[0], math.prod(shape[1:])),
                                generator=torch.Generator().manual_seed(3))
                state = cpu_c.state_dict()
                cpu_c.load_state_dict({**state, "q": q})
                dev_c.load_state_dict({**state, "q": q.to(device)})
            pc = cpu_c.compress(x)
            pd = dev_c.compress(x.to(device))
            where = f"{shape}/{str(dtype).removeprefix('torch.')}"
            for t in payload_tensors(pd):
                assert t.device == device, f"{where}: payload tensor on {t.device}"
            assert pd.nbytes == sum(t.numel() * t.element_size() for t in pd.tensors.values())
            assert pd.nbytes == pc.nbytes or cpu_c.variable_size, (
                f"{where}: nbytes cuda {pd.nbytes} != cpu {pc.nbytes}")
            packed = pack([pd])
            assert packed.numel() == pd.nbytes and packed.device == device, f"{where}: pack"
            for k in pd.tensors:
                assert pd.tensors[k].dtype == pc.tensors[k].dtype, f"{where}: wire dtype of {k}"
            yc, yd = cpu_c.decompress(pc), dev_c.decompress(pd)
            assert yd.device == device and yd.dtype == dtype and tuple(yd.shape) == shape, (
                f"{where}: out {yd.device} {yd.dtype} {tuple(yd.shape)}")
            assert torch.isfinite(yd.float()).all(), f"{where}: non-finite output"
            if name in DETERMINISTIC:
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
                else:
                    same = torch.equal(yc, yd.cpu())
                    if not same:
                        e = rel_err(yc, yd)
                        worst[where] = e
                        assert e < 1e-6, f"{where}: CPU/CUDA outputs differ (rel {e:.2e})"
            else:
                ec, ed = rel_err(x, yc), rel_err(x, yd)
                assert ed <= ec * 1.15 + 0.02, f"{where}: CUDA error {ed:.3f} vs CPU {ec:.3f}"
                # the same seed must give the same numbers on the same device (shared randomness)
                again = build(name).compress(x.to(device))
                assert all(torch.equal(a, b) for a, b in zip(payload_tensors(pd), payload_tensors(again),
                                                               strict=True)), f"{where}: CUDA not reproducible"
                if name == "randomk":
                    same_idx = torch.equal(pc.meta["indices"].cpu(), pd.meta["indices"].cpu())
                    info.setdefault("randomk_cpu_cuda_same_indices", same_idx)
    if worst:
        k = max(worst, key=lambda key: worst[key])
        notes.append(f"max CPU/CUDA diff {worst[k]:.2e} at {k}")
    elif name in DETERMINISTIC:
        notes.append("outputs equal to CPU")
    else:
        notes.append("error statistically equal to CPU, reproducible on device")
    return "; ".join(notes)


def count_syncs(fn: Callable[[], Any]) -> tuple[int, list[str]]:
    """Synchronising CUDA calls made by ``fn`` (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    hits = [w for w in caught if "called a synchronizing" in str(w.message)]
    return len(hits), [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in hits]


def sites(msgs: list[str]) -> str:
    counts: dict[str, int] = {}
    for m in msgs:
        if "site-packages" in m or "dist-packages" in m or "/torch/" in m:
            m = "torch"
        counts[m] = counts.get(m, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def profile_copies(fn: Callable[[], Any]) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts = {"HtoD": 0, "DtoH": 0, "local_scalar": 0, "nonzero": 0}
    for ev in prof.events():
        n = ev.name
        if "Memcpy HtoD" in n:
            counts["HtoD"] += 1
        elif "Memcpy DtoH" in n:
            counts["DtoH"] += 1
        elif n == "aten::_local_scalar_dense":
            counts["local_scalar"] += 1
        elif n == "aten::nonzero":
            counts["nonzero"] += 1
    return counts


def sync_and_speed(name: str, device: torch.device, quick: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"compressor": name}
    x1 = torch.randn(1024, 1024, device=device)
    c = build(name, BENCH_PARAMS[name])
    for _ in range(3):
        c.decompress(c.compress(x1))
    if device.type == "cuda":
        row["syncs_compress"], msgs = count_syncs(lambda: c.compress(x1))
        p = c.compress(x1)
        row["syncs_decompress"], msgs2 = count_syncs(lambda: c.decompress(p))
        row["sync_sites"] = sites(msgs + msgs2)
        row["copies"] = profile_copies(lambda: c.decompress(c.compress(x1)))
    n = 1 << 14 if quick else 1 << 24
    x = torch.randn(1024, n // 1024, device=device)
    c = build(name, BENCH_PARAMS[name])
    p = c.compress(x)
    c.decompress(p)
    times_c, times_d = [], []
    for _ in range(3 if quick else 10):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = c.compress(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        c.decompress(p)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        times_c.append(t1 - t0)
        times_d.append(t2 - t1)
    mc, md = statistics.median(times_c), statistics.median(times_d)
    row.update(numel=x.numel(), compress_ms=mc * 1e3, decompress_ms=md * 1e3,
               compress_gbps=x.numel() * 4 / mc / 1e9, wire_bytes=p.nbytes)
    return row


# --- 2. reducer / hook -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRANSPORT_PLANS = {  # one compressor per transport family (+ variable-size all-gather)
    "dense": "none", "allreduce-fp16": "fp16", "allreduce-randomk": "randomk",
    "allgather-topk": "topk", "allgather-var-dgc": "dgc_topk", "allgather-var-threshold": "threshold",
    "scalable-int8": "int8", "scalable-int4": "int4", "scalable-qsgd": "qsgd", "scalable-sign": "sign",
    "scalable-terngrad": "terngrad", "lowrank-powersgd": "powersgd",
}


def mixed_model(device: torch.device, width: int = 64) -> tuple[nn.Module, Plan]:
    torch.manual_seed(0)
    names = list(COMPRESSORS)
    layers: list[nn.Module] = []
    for _ in names:
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers).to(device)
    per_layer = {f"{2 * i}.weight": CompressorSpec.of(n, **PARAMS[n]) for i, n in enumerate(names)}
    return model, Plan.per_layer(per_layer, default=DENSE)


def reducer_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    from raycomp.reducer import CompressedReducer

    for label, name in TRANSPORT_PLANS.items():
        def one(name: str = name) -> str:
            reducer = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
            g = torch.randn(256, 64, generator=torch.Generator().manual_seed(rank + 1)).to(device)
            b = torch.randn(64, generator=torch.Generator().manual_seed(rank + 7)).to(device)
            notes = []
            for step in range(3):
                means = reducer.reduce(["w", "b"], [g, b])
                reducer.end_step()
                for m, ref in zip(means, (g, b), strict=True):
                    assert m.device == ref.device and m.dtype == ref.dtype and m.shape == ref.shape, (
                        f"step {step}: mean {m.device}/{m.dtype}/{tuple(m.shape)}")
                    assert torch.isfinite(m).all(), "non-finite mean"
                for t in getattr(reducer.memory, "residuals", {}).values():
                    assert t.device == device, f"residual on {t.device}"
            assert same_on_every_rank([means[0]]), "ranks disagree on the mean"
            if world > 1 and name in ("none", "fp16"):
                true = g.clone()
                dist.all_reduce(true)
                e = rel_err(true / world, means[0])
                assert e < 1e-3, f"mean off by {e:.2e}"
            if device.type == "cuda":
                n_sync, msgs = count_syncs(lambda: (reducer.reduce(["w", "b"], [g, b]), reducer.end_step()))
                notes.append(f"syncs/reduce={n_sync} [{sites(msgs)}]")
            return "; ".join(notes)

        guarded(f"{prefix}/reduce/{label}", one)


def ddp_checks(device: torch.device, prefix: str, rank: int, world: int, steps: int = 4) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.hook import CompressionState, compression_hook

    for async_comm in (True, False):
        def run(async_comm: bool = async_comm) -> str:
            model, plan = mixed_model(device)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            state = CompressionState(ddp, plan, min_compress_numel=256, async_comm=async_comm)
            calls = [0]

            def hook(s, bucket):  # noqa: ANN001
                calls[0] += 1
                return compression_hook(s, bucket)

            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(rank)
            losses = []
            for _ in range(steps):
                x = torch.randn(32, 64, generator=gen).to(device)
                y = torch.randint(0, 10, (32,), generator=gen).to(device)
                loss = nn.functional.cross_entropy(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss))
            assert calls[0] > 0, "DDP never called the comm hook"
            for p in model.parameters():
                assert torch.isfinite(p).all()
            assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
            sync_note = ""
            if device.type == "cuda" and not async_comm:
                x = torch.randn(32, 64, device=device)
                y = torch.randint(0, 10, (32,), device=device)

                def step() -> None:
                    loss = nn.functional.cross_entropy(ddp(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()

                n_sync, msgs = count_syncs(step)
                n_params = len(list(model.parameters()))
                sync_note = (f", syncs/step={n_sync} for {n_params} parameters "
                             f"({len(plan.layers)} compressed) [{sites(msgs)}]")
            state.close()
            return f"hook calls={calls[0]}, loss {losses[0]:.3f}->{losses[-1]:.3f}{sync_note}"

        guarded(f"{prefix}/ddp-hook-mixed(async={async_comm})", run)


def unused_layer_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """DDP with ``find_unused_parameters``: the hook on a group of its own beside DDP's
    all-reduce of used parameters, and a layer no rank used keeping its residual (the
    settling callback reads DDP's map on the device)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.hook import CompressionState, compression_hook

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 10), nn.Linear(256, 10)

        def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
            h = torch.relu(self.body(x))
            return self.a(h) + self.b(h) if both else self.a(h)

    for async_comm in (True, False):
        def run(async_comm: bool = async_comm) -> str:
            torch.manual_seed(0)
            model = TwoHeads().to(device)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      find_unused_parameters=True, bucket_cap_mb=0.01)
            state = CompressionState(ddp, Plan.uniform("topk", ratio=0.05), min_compress_numel=256,
                                     async_comm=async_comm)
            ddp.register_comm_hook(state, compression_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(rank)
            norms = []
            for step in range(4):  # head b: used, used, unused, unused
                x = torch.randn(32, 64, generator=gen).to(device)
                y = torch.randint(0, 10, (32,), generator=gen).to(device)
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x, both=step < 2), y).backward()
                opt.step()
                norms.append(float(state.memory.residual("b.weight").norm()))
            state.close()
            assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
            assert norms[2] == norms[1] == norms[3], f"head b's residual changed while unused: {norms}"
            return f"head b residual {norms[1]:.4f} kept over 2 unused steps"

        guarded(f"{prefix}/ddp-hook-find-unused(async={async_comm})", run)


def compiled_ddp_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """``torch.compile`` of a DDP model with the hook (DDPOptimizer splits the graph at each
    of its 8 buckets): the dense plan must give plain compiled DDP's parameters bit for bit,
    and int4 must train; both with the hook's threads."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.buckets import bucket_cap_mb
    from raycomp.hook import CompressionState, compression_hook

    def train(plan: Plan | None) -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(),
                              *[m for _ in range(5) for m in (nn.Linear(1024, 1024), nn.ReLU())],
                              nn.Linear(1024, 10)).to(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=bucket_cap_mb(model))
        state = None
        if plan is not None:
            state = CompressionState(ddp, plan, min_compress_numel=256)
            ddp.register_comm_hook(state, compression_hook)
        net = torch.compile(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(6):
            x = torch.randn(64, 64, generator=gen).to(device)
            y = torch.randint(0, 10, (64,), generator=gen).to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        if state is not None:
            state.close()
        assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
        return [p.detach().clone() for p in model.parameters()], losses

    def dense() -> str:
        plain, _ = train(None)
        hooked, _ = train(Plan())
        diff = max(float((a - b).abs().max()) for a, b in zip(plain, hooked, strict=True))
        assert diff == 0.0, f"the hook's dense plan differs from plain compiled DDP by {diff:.3g}"
        return "bit-identical to plain compiled DDP"

    def int4() -> str:
        _, losses = train(Plan.uniform("int4"))
        assert all(math.isfinite(v) for v in losses), f"non-finite loss: {losses}"
        return f"loss {losses[0]:.4f}->{losses[-1]:.4f}"

    guarded(f"{prefix}/ddp-hook-compiled(dense plan)", dense)
    guarded(f"{prefix}/ddp-hook-compiled(int4)", int4)


def group_timeout_check(device: torch.device) -> str:
    """``raycomp.ddp.timeout_of`` reads a group's timeout from its backend's options: the
    hook's own group takes DDP's. On NCCL the options sit behind the CUDA device."""
    import datetime

    from raycomp.ddp import timeout_of

    wanted = datetime.timedelta(seconds=77)
    got = timeout_of(dist.new_group(timeout=wanted))
    assert got == wanted, f"timeout_of gave {got}, the group was created with {wanted}"
    return f"{dist.get_backend()}: {got.total_seconds():.0f} s read back"


def loss_scale_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """fp16 loss scaling through the hook (``CompressionState(grad_scaler=...)``).

    1. Scales set to powers of two: the run whose memory follows the scale must be the run
       without a scaler, bit for bit (as on the CPU: ``tests/test_loss_scale.py``).
    2. fp16 autocast with a GradScaler left to itself, from a scale that overflows: it
       backs off, skips those steps and grows again; the loss must stay finite and fall.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.hook import CompressionState, compression_hook

    scales = [2.0**4, 2.0**6, 2.0**3, 2.0**9, 2.0**5, 2.0**2] * 2
    plans = {"topk": Plan.uniform("topk", ratio=0.01), "int8": Plan.uniform("int8", chunk_size=512),
             "powersgd": Plan.uniform("powersgd", rank=1)}

    def train(plan: Plan, scaled: bool, amp: bool, steps: int) -> tuple[list[torch.Tensor], list[float], str]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10)).to(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        scaler = None
        if amp:
            scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24, growth_interval=8)
        elif scaled:
            scaler = torch.amp.GradScaler(device.type, init_scale=scales[0])
        state = CompressionState(ddp, plan, min_compress_numel=256, grad_scaler=scaler)
        ddp.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        losses, seen = [], []
        for step in range(steps):
            x = torch.randn(64, 64, generator=gen).to(device)
            y = torch.randint(0, 10, (64,), generator=gen).to(device)
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                loss = nn.functional.cross_entropy(ddp(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                seen.append(scaler.get_scale())
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update(None if amp else scales[(step + 1) % len(scales)])
            losses.append(float(loss.detach()))
        state.close()
        assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
        skipped = sum(b < a for a, b in zip(seen, seen[1:], strict=False))
        return [p.detach().clone() for p in model.parameters()], losses, f"scale {seen[:1]}..{seen[-1:]}, {skipped} backoffs"

    for name, plan in plans.items():
        def follows(plan: Plan = plan) -> str:
            plain, _, _ = train(plan, False, False, len(scales))
            scaled, _, _ = train(plan, True, False, len(scales))
            diff = max(float((a - b).abs().max()) for a, b in zip(plain, scaled, strict=True))
            assert diff == 0.0, f"parameters differ from the run without a scaler by {diff:.3g}"
            return "bit-identical to the run without a scaler"

        guarded(f"{prefix}/loss-scale/{name} follows powers of two", follows)

    if device.type == "cuda":
        def syncs() -> str:  # following the scale must cost no host sync: count a backward's
            counts = {}
            for follow in (False, True):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
                ddp = DDP(model, device_ids=[device.index])
                scaler = torch.amp.GradScaler("cuda", init_scale=2.0**4)
                state = CompressionState(ddp, plans["topk"], min_compress_numel=256, async_comm=False,
                                         grad_scaler=scaler if follow else None)
                ddp.register_comm_hook(state, compression_hook)
                x = torch.randn(64, 64, device=device)
                y = torch.randint(0, 10, (64,), device=device)
                def backward(ddp: DDP = ddp, scaler: torch.amp.GradScaler = scaler,
                             x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                    scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()

                for step in range(3):  # the last backward is counted, after a change of scale
                    if step == 2:
                        counts[follow] = count_syncs(backward)
                    else:
                        backward()
                        scaler.update(2.0**(5 + step))
                    ddp.zero_grad()
                state.close()
            assert counts[True][0] == counts[False][0], f"followed {counts[True]}, not followed {counts[False]}"
            return f"syncs in a backward: {counts[True][0]} followed, {counts[False][0]} not [{sites(counts[True][1])}]"

        guarded(f"{prefix}/loss-scale/host syncs of following the scale", syncs)

        def amp_run() -> str:
            _, losses, note = train(plans["topk"], True, True, 60)
            assert all(math.isfinite(v) for v in losses), f"non-finite loss: {losses}"
            assert sum(losses[-10:]) < sum(losses[:10]), f"loss did not fall: {losses[:3]} .. {losses[-3:]}"
            return f"fp16 autocast, loss {sum(losses[:10]) / 10:.3f}->{sum(losses[-10:]) / 10:.3f}, {note}"

        guarded(f"{prefix}/loss-scale/fp16 autocast + GradScaler (topk)", amp_run)


def _cpu_copy(state: Any) -> Any:
    buf = __import__("io").BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _to(state: Any, device: torch.device) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    return state


def checkpoint_to_cpu_resume(device: torch.device, prefix: str) -> None:
    """Each stateful part resumed on CUDA from a state loaded with map_location='cpu'."""
    from raycomp.reducer import CompressedReducer

    for name in ("powersgd", "randomk", "qsgd", "terngrad", "dgc_topk"):
        def comp(name: str = name) -> str:
            x = torch.randn(256, 129, device=device)
            c1 = build(name)
            c1.compress(x)
            c2 = build(name)
            c2.load_state_dict(_cpu_copy(c1.state_dict()))
            p = c2.compress(x)
            assert all(t.device == device for t in payload_tensors(p))
            return ""

        guarded(f"{prefix}/resume-cpu-state/compressor-{name}", comp)

    for label, name, move in (("memory-on-cpu", "topk", "server_residuals"),
                              ("server-residuals-on-cpu", "int8", "memory")):
        def part(name: str = name, move: str = move) -> str:
            g = torch.randn(256, 64, device=device)
            r1 = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
            r1.reduce(["w"], [g])
            r1.end_step()
            state = _cpu_copy(r1.state_dict())
            state[move] = _to(state[move], device)  # only the other part stays on the CPU
            r2 = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
            r2.load_state_dict(state)
            r2.reduce(["w"], [g])
            return ""

        guarded(f"{prefix}/resume-cpu-state/reducer-{label}", part)


def checkpoint_to_cpu_resume_whole(device: torch.device, prefix: str) -> None:
    """A reducer state saved with map_location='cpu' (as Ray checkpoints often are) resumed on CUDA."""
    from raycomp.reducer import CompressedReducer

    for label, name in (("powersgd", "powersgd"), ("residual-topk", "topk"), ("server-int8", "int8")):
        def one(name: str = name) -> str:
            g = torch.randn(256, 64, device=device)
            r1 = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
            r1.reduce(["w"], [g])
            r1.end_step()
            state = r1.state_dict()
            buf = __import__("io").BytesIO()
            torch.save(state, buf)
            buf.seek(0)
            cpu_state = torch.load(buf, map_location="cpu", weights_only=True)
            r2 = CompressedReducer(Plan.uniform(name, **PARAMS[name]), min_compress_numel=64)
            r2.load_state_dict(cpu_state)
            (m,) = r2.reduce(["w"], [g])
            r2.end_step()
            assert m.device == device
            return ""

        guarded(f"{prefix}/resume-cpu-checkpoint/{label}", one)


def nccl_cpu_tensor_demo(prefix: str) -> None:
    """NCCL refuses CPU tensors: why ``collectives.sparse_allgather`` keeps its element
    counts on the payloads' device (it built them on the CPU before the first GPU run)."""

    def one() -> str:
        counts = torch.tensor([3, 4], dtype=torch.int64)  # on the CPU
        out = [torch.empty_like(counts)]
        try:
            dist.all_gather(out, counts)
        except RuntimeError as error:
            return f"refused as expected ({str(error)[:80]})"
        raise AssertionError("NCCL accepted a CPU tensor")

    guarded(f"{prefix}/NCCL refuses CPU count tensors (sparse counts live on the device)", one)


# --- 2b. control rows, the adaptive ladder's rungs --------------------------------------------


def control_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """The guard's control floats (``stage_control``) ride in the step's last reduction:
    appended to the dense all-reduce when the reduction has a dense layer, else in a small
    all-reduce of their own. Every rank must read every rank's row; the gradients' means
    must not change; a NaN on one rank must raise that rank's flag on every rank."""
    from raycomp.reducer import CompressedReducer

    plan = Plan.uniform("int8", **PARAMS["int8"])
    cases = (("carried-in-dense", ["w", "b"], False), ("own-allreduce", ["w"], False),
             ("nan-on-last-rank", ["w", "b"], True))
    for label, names, nan in cases:
        def one(names: list[str] = names, nan: bool = nan) -> str:
            gen = torch.Generator().manual_seed(rank + 1)
            grads = [torch.randn(256, 64, generator=gen).to(device), torch.randn(64, generator=gen).to(device)]
            grads = grads[: len(names)]
            if nan and rank == world - 1:
                grads[0][3, 5] = float("nan")
            with_control = CompressedReducer(plan, min_compress_numel=256)
            without = CompressedReducer(plan, min_compress_numel=256)
            with_control.stage_control([rank + 0.5, 7.0])
            means = with_control.reduce(names, [g.clone() for g in grads], closes_step=True)
            rows = with_control.control_rows
            assert rows is not None, "no control rows after the closing reduction"
            plain = without.reduce(names, [g.clone() for g in grads], closes_step=True)
            n_sync = ""
            if device.type == "cuda":
                probe = CompressedReducer(plan, min_compress_numel=256)
                probe.stage_control([1.0, 2.0])
                k, msgs = count_syncs(lambda: probe.reduce(names, [g.clone() for g in grads], closes_step=True))
                n_sync = f"; syncs in reduce with control={k} [{sites(msgs)}]"
            got = rows.detach().cpu()
            flags = [1.0 if nan and r == world - 1 else 0.0 for r in range(world)]
            expected = torch.tensor([[flags[r], r + 0.5, 7.0] for r in range(world)])
            assert torch.equal(got, expected), f"control rows {got.tolist()} != {expected.tolist()}"
            if not nan:
                for a, b in zip(means, plain, strict=True):
                    assert torch.equal(a, b), "the carried control changed a gradient's mean"
            with_control.end_step()
            assert with_control.local_nonfinite == (nan and rank == world - 1)
            return f"rows on {rows.device}, {got.tolist()}{n_sync}"

        guarded(f"{prefix}/control-rows/{label}", one)


LADDER = [  # plans the adaptive policy can hand out, lossy rungs to dense, one per step
    ["powersgd1"] * 6,
    ["powersgd2", "topk", "int4", "int8", "bf16", "none"],
    ["int4"] * 6,
    ["int8"] * 6,
    ["bf16"] * 6,
    ["bf16", "int8", "none", "powersgd2", "int4", "int8"],
    ["none"] * 6,
    ["int8"] * 6,
]
RUNGS = {"powersgd1": CompressorSpec.of("powersgd", rank=1), "powersgd2": CompressorSpec.of("powersgd", rank=2),
         "topk": CompressorSpec.of("topk", ratio=0.01), "int8": CompressorSpec.of("int8"),
         "int4": CompressorSpec.of("int4"),
         "bf16": CompressorSpec.of("bf16"), "none": DENSE}


def ladder_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """The DDP hook while the plan moves down and up the adaptive policy's ladder (PowerSGD,
    Top-K, then the near-lossless int8 and bf16 rungs, then dense), one plan per step, with
    error feedback carried across the switches. Syncs per step are counted per rung."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.hook import CompressionState, compression_hook

    def run() -> str:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())],
                              nn.Linear(128, 10)).to(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        state = CompressionState(ddp, Plan(), min_compress_numel=256, async_comm=False)
        ddp.register_comm_hook(state, compression_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        x_all = torch.randn(len(LADDER) * 32, 128, generator=gen).to(device)
        y_all = torch.randint(0, 10, (len(LADDER) * 32,), generator=gen).to(device)
        syncs: dict[str, int] = {}
        losses = []
        for step, rungs in enumerate(LADDER):
            state.set_plan(Plan.per_layer({f"{2 * i}.weight": RUNGS[r] for i, r in enumerate(rungs)},
                                          default=DENSE))
            x, y = x_all[step * 32:(step + 1) * 32], y_all[step * 32:(step + 1) * 32]

            def one_step(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = nn.functional.cross_entropy(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                return loss.detach()

            if device.type == "cuda":
                box: list[Any] = []
                syncs["/".join(sorted(set(rungs)))], _ = count_syncs(
                    lambda f=one_step, out=box: out.append(f()))
                losses.append(float(box[0]))
            else:
                losses.append(float(one_step()))
        state.close()
        assert all(math.isfinite(v) for v in losses), f"non-finite loss {losses}"
        for p in model.parameters():
            assert torch.isfinite(p).all(), "non-finite parameter"
        assert same_on_every_rank(list(model.parameters())), "parameters diverged across ranks"
        note = f"{len(LADDER)} plans, loss {losses[0]:.3f}->{losses[-1]:.3f}"
        if syncs:
            note += "; syncs/step: " + ", ".join(f"{k}={v}" for k, v in syncs.items())
        return note

    guarded(f"{prefix}/ddp-hook-ladder(int4/int8/bf16 rungs, plan per step)", run)


# --- 2b'. DDP's buckets, the hook's threads and the caller's CUDA stream -------------------


def kjv_transformer(device: torch.device) -> nn.Module:
    """The model ``jobs/configs/gpt_kjv.yaml`` trains (3,224,639 parameters), built from its
    sizes here: ``jobs.workloads.model_of`` needs pydantic, PyYAML and the KJV text, which a
    GPU machine may lack, and this check must run with torch alone.
    ``tests/test_device.py`` checks that the two stay the same model."""
    from jobs.models import char_transformer

    torch.manual_seed(0)
    return char_transformer(vocab_size=63, block=128, d_model=256, heads=4, layers=4).to(device)


def _hook_means(device: torch.device, rank: int, plan: Plan, *, auto: bool, async_comm: bool,
                side_stream: str = "", steps: int = 2) -> tuple[list[int], list[torch.Tensor], int]:
    """The bucket sizes DDP hands raycomp's hook at the last step (DDP rebuilds its
    buckets after the first), every parameter's mean gradient after it, and the syncs of
    the last step. ``side_stream``: forward and backward run on a stream of their own, and
    backward starts with ~0.1 s of GPU sleep, so every gradient is written well after the
    hook is called; work on another stream reads the buckets too early, or DDP copies
    the means into ``.grad`` before they are decoded. ``"train"``: only the steps run on
    it (autograd then hands DDP the gradients on the default stream, where DDP built its
    gradient accumulators); ``"all"``: the model and DDP are built on it as well."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.buckets import bucket_cap_mb
    from raycomp.hook import CompressionState, compression_hook

    side = torch.cuda.Stream(device) if side_stream else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side if side_stream == "all" else None):
        model = kjv_transformer(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  **({"bucket_cap_mb": bucket_cap_mb(model)} if auto else {}))
    state = CompressionState(ddp, plan, async_comm=async_comm)
    sizes: list[int] = []

    def counting(s, bucket):  # noqa: ANN001 - unannotated: DDP checks hook annotations
        sizes.append(bucket.buffer().numel())
        return compression_hook(s, bucket)

    ddp.register_comm_hook(state, counting)
    syncs = 0
    for step in range(steps):
        sizes.clear()
        ddp.zero_grad()
        tokens = torch.randint(0, 63, (2, 128), generator=torch.Generator().manual_seed(10 * rank + step))
        tokens = tokens.to(device)

        def one_step(tokens: torch.Tensor = tokens) -> None:
            if side is None:
                ddp(tokens).logsumexp(-1).mean().backward()
                return
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                loss = ddp(tokens).logsumexp(-1).mean()  # this forward waits for its stream on the host
                torch.cuda._sleep(200_000_000)
                loss.backward()
            torch.cuda.current_stream(device).wait_stream(side)

        if device.type == "cuda" and step == steps - 1 and side is None:
            syncs, _ = count_syncs(one_step)
        else:
            one_step()
    state.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sizes, [p.grad.detach().clone() for p in model.parameters()], syncs


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    """'' if every tensor is bit-identical, else the worst relative difference."""
    if all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
        return ""
    return f"differ (worst relative difference {max(rel_err(x, y) for x, y in zip(a, b, strict=True)):.2e})"


def bucket_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """The production path of the hook on the KJV transformer: ``raycomp.bucket_cap_mb``'s
    buckets (about eight) against DDP's default (two), with and without the hook's
    background threads. int4 is deterministic, so all four must give the same means bit
    for bit. Then the same step with forward and backward on the caller's own CUDA stream,
    for int4 and for the dense plan (sent inline, waited for on the receiving thread)."""
    int4 = Plan.uniform("int4")
    runs: dict[tuple[bool, bool], tuple[list[int], list[torch.Tensor], int]] = {}

    def buckets() -> str:
        for auto in (True, False):
            for async_comm in (True, False):
                runs[auto, async_comm] = _hook_means(device, rank, int4, auto=auto, async_comm=async_comm)
        sizes_auto, sizes_ddp = runs[True, True][0], runs[False, True][0]
        assert 6 <= len(sizes_auto) <= 16, f"auto: {len(sizes_auto)} buckets {sizes_auto}"
        assert len(sizes_ddp) <= 3, f"DDP's default: {len(sizes_ddp)} buckets"
        ref = runs[False, False][1]
        for key, (_, means, _) in runs.items():
            diff = _same(ref, means)
            assert not diff, f"auto={key[0]}, async={key[1]}: means {diff} from DDP's default buckets inline"
        assert same_on_every_rank(ref), "ranks disagree on the means"
        note = (f"{len(sizes_auto)} buckets with auto, {len(sizes_ddp)} with DDP's default; "
                "int4 means bit-identical across buckets x threads")
        if device.type == "cuda":
            note += "; syncs/step: " + ", ".join(
                f"{'auto' if a else 'ddp'}/{'async' if t else 'inline'}={runs[a, t][2]}" for a, t in runs)
        return note

    guarded(f"{prefix}/ddp-buckets(int4, auto vs DDP's default, threads vs inline)", buckets)
    if device.type != "cuda":
        return
    for label, plan in (("int4", int4), ("dense", Plan())):
        for async_comm in (True, False):
            def stream(plan: Plan = plan, async_comm: bool = async_comm) -> str:
                _, ref, _ = _hook_means(device, rank, plan, auto=True, async_comm=async_comm)
                for where in ("train", "all"):
                    _, means, _ = _hook_means(device, rank, plan, auto=True, async_comm=async_comm,
                                              side_stream=where)
                    diff = _same(ref, means)
                    assert not diff, f"{where} on the caller's stream: means {diff} from the default stream's"
                return "steps, and model + DDP + steps, on a stream of their own: means bit-identical"

            guarded(f"{prefix}/ddp-caller-stream({label}, async={async_comm})", stream)


_CPU_RUN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from raycomp import Plan
from raycomp.hook import CompressionState, compression_hook
from jobs.gpu_check import kjv_transformer
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
model = kjv_transformer(torch.device("cpu"))
ddp = DDP(model)
state = CompressionState(ddp, Plan.uniform("int4"), async_comm=True)
ddp.register_comm_hook(state, compression_hook)
ddp(torch.randint(0, 63, (2, 128))).logsumexp(-1).mean().backward()
state.close()
print("cuda initialised:", torch.cuda.is_initialized())
"""


def cpu_run_on_a_cuda_machine() -> str:
    """A CPU run of the hook with its threads, in a fresh process on a machine with CUDA,
    must not initialise CUDA (a forked worker that did would fail; ``torch.cuda.stream``
    does initialise it, even with ``None``)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CPU_RUN % free_port()], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-400:]
    assert "cuda initialised: False" in out.stdout, out.stdout[-200:]
    return "CUDA left uninitialised"


# --- 2c. sharded data parallel (FSDP2, raycomp.sharded) -------------------------------------

SHARDED_TOL = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "int8": 3e-2}  # rel. error of the mean shard
SHARDED_OTHERS = ("sign", "qsgd", "terngrad")  # lossy: finite, on the device, error noted


def sharded_api(fsdp: bool = False) -> str:
    """Why raycomp.sharded (and, with ``fsdp``, FSDP2's custom reduce-scatter) cannot run
    on this torch, or '' if it can."""
    try:
        import raycomp.sharded  # noqa: F401
    except ImportError as error:
        return f"torch {torch.__version__}: raycomp.sharded does not import ({error})"
    from torch.distributed.fsdp import FSDPModule

    if fsdp and not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        return f"torch {torch.__version__}: FSDPModule has no set_custom_reduce_scatter"
    return ""


def _rs_input(rank: int, world: int, n: int, step: int = 0) -> torch.Tensor:
    return torch.randn(world * n, generator=torch.Generator().manual_seed(100 * step + rank))


def sharded_comm_checks(device: torch.device, prefix: str, rank: int, world: int) -> None:
    """:class:`raycomp.sharded.CompressedReduceScatter` called as FSDP2 calls it: the shard
    each rank receives against the true mean of every rank's input (computed here, no
    collective), on ``device``; on gloo also against the same comm run on CPU tensors."""
    reason = sharded_api()
    if reason:
        skip(f"{prefix}/sharded/comm", reason)
        return
    from raycomp.sharded import CompressedReduceScatter

    n = 4099  # per shard; not a multiple of the int8 chunk, odd byte rows
    group = dist.group.WORLD
    cpu_twin = dist.get_backend() == "gloo"
    truth = sum(_rs_input(r, world, n) for r in range(world)) / world
    mine = truth.view(world, n)[rank]
    for name in (*SHARDED_TOL, *SHARDED_OTHERS):
        def one(name: str = name) -> str:
            spec = CompressorSpec.of(name, **PARAMS[name])
            comm = CompressedReduceScatter(spec, name="unit", rank=rank)
            out = comm.allocate((n,), dtype=torch.float32, device=device)
            comm(out, _rs_input(rank, world, n).to(device), group, dist.ReduceOp.AVG)
            assert out.device == device, f"output on {out.device}"
            assert torch.isfinite(out).all(), "non-finite shard"
            if comm.residual is not None:
                assert comm.residual.device == device, f"residual on {comm.residual.device}"
            e = rel_err(mine, out)
            if name in SHARDED_TOL:
                assert e <= SHARDED_TOL[name], f"mean off by {e:.2e} > {SHARDED_TOL[name]}"
            notes = [f"rel. error of the mean {e:.2e}"]
            if cpu_twin:
                twin = CompressedReduceScatter(spec, name="unit", rank=rank)
                out_cpu = torch.empty(n)
                twin(out_cpu, _rs_input(rank, world, n), group, dist.ReduceOp.AVG)
                d = rel_err(out_cpu, out)
                notes.append(f"vs CPU run {d:.2e}")
                if name in ("none", "fp16", "bf16"):
                    assert d < 1e-6, f"CPU and {device.type} differ by {d:.2e}"
            if name == "none":
                total = comm.allocate((n,), dtype=torch.float32, device=device)
                comm(total, _rs_input(rank, world, n).to(device), group, dist.ReduceOp.SUM)
                e_sum = rel_err(mine * world, total)
                assert e_sum < 1e-6, f"SUM off by {e_sum:.2e}"
            if device.type == "cuda":
                x = _rs_input(rank, world, n).to(device)
                k, msgs = count_syncs(lambda: comm(out, x, group, dist.ReduceOp.AVG))
                notes.append(f"syncs/call={k}" + (f" [{sites(msgs)}]" if k else ""))
            if world > 1:
                notes.append(f"wire {comm.sent_bytes / comm.dense_bytes:.3f} of fp32")
            return ", ".join(notes)

        guarded(f"{prefix}/sharded/comm/{name}", one)

    def half() -> str:  # FSDP with reduce_dtype=bf16 hands the comm bf16 tensors
        comm = CompressedReduceScatter(CompressorSpec.of("int8"), name="unit", rank=rank)
        out = comm.allocate((n,), dtype=torch.bfloat16, device=device)
        comm(out, _rs_input(rank, world, n).to(device, torch.bfloat16), group, dist.ReduceOp.AVG)
        assert out.dtype == torch.bfloat16 and out.device == device, f"output {out.dtype} on {out.device}"
        e = rel_err(mine, out)
        assert e <= 3e-2, f"mean off by {e:.2e}"
        return f"rel. error of the mean {e:.2e}"

    guarded(f"{prefix}/sharded/comm/int8 (bf16 in and out)", half)

    for name in ("sign", "qsgd"):  # residual (sign) and random-draw state (qsgd)
        def resume(name: str = name) -> str:
            spec = CompressorSpec.of(name, **PARAMS[name])
            first = CompressedReduceScatter(spec, name="unit", rank=rank)
            for step in range(2):
                first(first.allocate((n,), dtype=torch.float32, device=device),
                      _rs_input(rank, world, n, step).to(device), group, dist.ReduceOp.AVG)
            again = CompressedReduceScatter(CompressorSpec.of("int8"), name="unit", rank=rank)
            again.load_state_dict(_cpu_copy(first.state_dict()))  # a checkpoint loaded on the CPU
            x = _rs_input(rank, world, n, 2).to(device)
            a, b = torch.empty(n, device=device), torch.empty(n, device=device)
            first(a, x.clone(), group, dist.ReduceOp.AVG)
            again(b, x.clone(), group, dist.ReduceOp.AVG)
            assert torch.equal(a, b), f"resumed shard differs (rel {rel_err(a, b):.2e})"
            return "bit-identical to the run that never stopped"

        guarded(f"{prefix}/sharded/resume-cpu-state/{name}", resume)


def _sharded_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 96), nn.ReLU(), nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 8)).to(device)


def _sharded_batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 24, generator=g)
    w = torch.randn(24, 8, generator=torch.Generator().manual_seed(5)) / 5  # a learnable target
    return x.to(device), (x @ w + 0.05 * torch.randn(16, 8, generator=g)).to(device)


def _full(t: torch.Tensor, world: int) -> torch.Tensor:
    """A DTensor sharded evenly on dim 0, whole, gathered with the list form of all_gather
    (``full_tensor()`` killed both gloo processes with SIGSEGV on CUDA tensors, torch
    2.11.0+cu130, 2026-11-23; the probe of it records whether it still does)."""
    local = t.to_local().contiguous()
    if world == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    return torch.cat(parts)


def list_all_gather() -> Any:
    """FSDP2's parameter all-gather through the list form of ``all_gather``: a stand-in,
    for this test only, where the backend cannot all-gather CUDA tensors into one tensor."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class ListAllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> Any:
            world = dist.get_world_size(group)
            return dist.all_gather(list(output_tensor.chunk(world)), input_tensor.contiguous(),
                                   group=group, async_op=async_op)

    return ListAllGather()


FSDP_VARIANTS = [  # (label, compressor or None for FSDP's own reduce-scatter, bf16 parameters)
    ("plain", None, False), ("plain+bf16-params", None, True),
    ("none", "none", False), ("bf16", "bf16", False), ("int8", "int8", False),
    ("int8+bf16-params", "int8", True),
]


def sharded_fsdp_checks(device: torch.device, prefix: str, rank: int, world: int, steps: int = 6,
                        own_all_gather: bool = False, plain_reason: str = "") -> None:
    """``fully_shard`` per layer + ``compress_fsdp``, SGD for a few steps. Against a local
    replica trained on the mean of every rank's gradient (computed here, no collective):
    the first step's full gradients, the loss (finite, falling) and the parameters after
    the last step; parameters gathered from every rank must be identical. "plain" runs are
    FSDP's own reduce-scatter: a compressed run that fails exactly as its plain run does is
    SKIP (torch's failure, not raycomp's). ``own_all_gather``: FSDP's parameter all-gather
    goes through :func:`list_all_gather`; ``plain_reason``: why plain runs cannot run here."""
    reason = sharded_api(fsdp=True)
    if reason:
        skip(f"{prefix}/sharded/fsdp", reason)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from raycomp.sharded import compress_fsdp

    if own_all_gather and not hasattr(FSDPModule, "set_custom_all_gather"):
        skip(f"{prefix}/sharded/fsdp", f"torch {torch.__version__}: the backend cannot all-gather "
             "into one tensor here and FSDPModule has no set_custom_all_gather")
        return
    mesh = init_device_mesh(device.type, (world,))
    lr = 0.2

    reference = _sharded_model(device)  # local replica: SGD on the true mean gradient
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_grads, ref_losses = [], []
    for step in range(steps):
        ref_opt.zero_grad()
        losses = []
        for r in range(world):
            x, y = _sharded_batch(r, 0, device)  # one fixed batch per rank: the loss falls steadily
            loss = nn.functional.mse_loss(reference(x).float(), y) / world
            loss.backward()
            losses.append(float(loss.detach()) * world)
        ref_losses.append(losses[rank])
        if step == 0:
            ref_grads = [p.grad.detach().clone() for p in reference.parameters()]
        ref_opt.step()
    ref_params = [p.detach().clone() for p in reference.parameters()]

    plain_errors: dict[bool, str] = {}
    for label, name, bf16_params in FSDP_VARIANTS:
        check = f"{prefix}/sharded/fsdp-train/{label}"
        if name is None and plain_reason:
            skip(check, plain_reason)
            continue

        def one(name: str | None = name, bf16_params: bool = bf16_params) -> str:
            model = _sharded_model(device)
            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if bf16_params else MixedPrecisionPolicy())
            units = []
            for layer in model:
                if isinstance(layer, nn.Linear):
                    units.append(fully_shard(layer, mesh=mesh, mp_policy=mp))
            units.append(fully_shard(model, mesh=mesh, mp_policy=mp))
            if own_all_gather:
                for unit in units:
                    unit.set_custom_all_gather(list_all_gather())
            comms = compress_fsdp(model, CompressorSpec.of(name, **PARAMS[name])) if name else {}
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            losses = []
            grad_err = 0.0
            for step in range(steps):
                x, y = _sharded_batch(rank, 0, device)
                loss = nn.functional.mse_loss(model(x).float(), y)  # bf16 parameters: bf16 output
                opt.zero_grad()
                try:
                    loss.backward()
                except Exception as error:
                    if name is None:
                        plain_errors[bf16_params] = f"{type(error).__name__}: {error}"
                    elif plain_errors.get(bf16_params) == f"{type(error).__name__}: {error}":
                        raise Skip(f"torch's own FSDP (no raycomp comm) fails the same way here: "
                                   f"{type(error).__name__}: {error}") from error
                    raise
                if step == 0:
                    for p, ref in zip(model.parameters(), ref_grads, strict=True):
                        full = _full(p.grad, world)
                        assert full.device == device, f"gradient on {full.device}"
                        grad_err = max(grad_err, rel_err(ref, full))
                opt.step()
                losses.append(float(loss))
            full = [_full(p.detach(), world) for p in model.parameters()]
            param_err = max(rel_err(r, f) for r, f in zip(ref_params, full, strict=True))
            assert same_on_every_rank(full), "parameters differ across ranks"
            calls = sum(c.calls for c in comms.values())
            assert all(math.isfinite(v) for v in losses), f"non-finite loss {losses}"
            assert losses[-1] < losses[0], f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})"
            bound = 5e-2 if bf16_params else SHARDED_TOL[name or "none"]
            if world > 1:
                if name:
                    assert calls == steps * 3, f"the compressed reduce-scatter ran {calls} times, expected {steps * 3}"
                assert grad_err <= bound, f"first-step gradient off the true mean by {grad_err:.2e} > {bound}"
            if name in (None, "none") and not bf16_params:
                assert param_err < 1e-5, f"parameters off the replica by {param_err:.2e}"
            note = (f"loss {losses[0]:.4f}->{losses[-1]:.4f} (replica {ref_losses[0]:.4f}->{ref_losses[-1]:.4f}), "
                    f"grad err {grad_err:.2e}, params vs replica {param_err:.2e}")
            if name:
                note += f", comm calls {calls}"
                if world == 1 and calls == 0:
                    note += " (FSDP skips the reduce-scatter at world size 1)"
            if own_all_gather:
                note += "; FSDP's all-gather via list all_gather (test stand-in)"
            return note

        guarded(check, one)


def sharded_state_checks(device: torch.device, prefix: str, rank: int, world: int,
                         own_all_gather: bool = False) -> None:
    """``ShardedState`` (what ``raycomp.train`` installs on a ``fully_shard`` model) on
    this device: a plan per unit (int8, int4, bf16) installed at the next step, the guard's
    control floats carried with the last unit's reduce-scatter (exchanged on their own
    where FSDP calls none), every rank's row on every rank, statistics at the stats step,
    a NaN on the last rank flagged everywhere, and the host syncs of a step."""
    reason = sharded_api(fsdp=True)
    if reason:
        skip(f"{prefix}/sharded/state", reason)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from raycomp.sharded_state import ShardedState

    def run() -> str:
        mesh = init_device_mesh(device.type, (world,))
        model = _sharded_model(device)
        units = [fully_shard(layer, mesh=mesh) for layer in model if isinstance(layer, nn.Linear)]
        units.append(fully_shard(model, mesh=mesh))
        if own_all_gather:
            for unit in units:
                unit.set_custom_all_gather(list_all_gather())
        state = ShardedState(model, stats_every=2, min_compress_numel=256)
        plan = Plan.per_layer({"0": CompressorSpec.of("int8"), "2": CompressorSpec.of("int4"),
                               "4": CompressorSpec.of("bf16")})
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        notes = []
        for step in range(3):
            x, y = _sharded_batch(rank, step, device)
            if step == 2 and rank == world - 1:
                x = x * float("nan")
            loss = nn.functional.mse_loss(model(x), y)
            state.stage_control([10.0 * rank + step, 1.0, 0.5])
            opt.zero_grad()

            def backward(loss: torch.Tensor = loss) -> None:
                loss.backward()
                state.end_backward()

            if device.type == "cuda" and step < 2:  # step 1 measures statistics
                k, msgs = count_syncs(backward)
                notes.append(f"syncs/step {'with' if step else 'without'} statistics={k} [{sites(msgs)}]")
            else:
                backward()
            rows = state.control_rows
            assert rows is not None and tuple(rows.shape) == (world, 4), f"step {step}: rows {rows}"
            assert same_on_every_rank([rows.to(device)]), f"step {step}: ranks hold different control rows"
            assert rows[:, 1].tolist() == [10.0 * r + step for r in range(world)], f"step {step}: {rows}"
            if step < 2:
                assert rows[:, 0].eq(0).all() and math.isfinite(state.gradient_norm([])), f"step {step}: {rows}"
                opt.step()
            else:
                assert rows[-1, 0] == 1.0 and rows[:-1, 0].eq(0).all(), f"NaN not flagged where it was: {rows}"
                assert not math.isfinite(state.gradient_norm([])), "a NaN gradient with a finite norm"
                state.discard_step()
            specs = {name: comm.spec.name for name, comm in state.comms.items()}
            if step == 0:
                assert specs == {"0": "none", "2": "none", "4": "none"}, f"step 0 not dense: {specs}"
                state.set_plan(plan)  # between steps: installed now
            if step == 1:
                assert specs == {"0": "int8", "2": "int4", "4": "bf16"}, f"plan not applied: {specs}"
                calls = sum(c.calls for c in state.comms.values())
                if world > 1:
                    assert sorted(st.compressor for st in state.stats) == ["bf16", "int4", "int8"], state.stats
                    assert all(math.isfinite(st.compression_error) for st in state.stats), state.stats
                    notes.append(f"stats {[(st.layer, round(st.compression_error, 4)) for st in state.stats]}")
                else:
                    notes.append(f"comm calls {calls} (FSDP skips the reduce-scatter at world size 1; "
                                 "control rows exchanged on their own)")
        for p in model.parameters():
            assert p.device.type == device.type and torch.isfinite(p.to_local()).all(), "parameters"
        if world > 1:
            notes.append(f"wire {state.ledger.wire_total:.0f} B")
        return "; ".join(notes)

    guarded(f"{prefix}/sharded/state(plan per unit, control rows, stats, NaN flag)", run)


# --- 3. training -------------------------------------------------------------------------


def training_runs(device: torch.device, quick: bool, only: str = "") -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from jobs.models import char_transformer, lm_loss
    from raycomp.buckets import bucket_cap_mb
    from raycomp.hook import CompressionState, compression_hook

    vocab, block, batch, steps = 32, 64, 32, (8 if quick else 50)
    g = torch.Generator().manual_seed(0)
    n_tokens = 200_000
    tokens = torch.empty(n_tokens, dtype=torch.long)
    tokens[0] = 0
    noise = torch.rand(n_tokens, generator=g) < 0.1
    rand = torch.randint(0, vocab, (n_tokens,), generator=g)
    for i in range(1, n_tokens):  # a learnable rule plus 10% noise
        tokens[i] = rand[i] if noise[i] else (tokens[i - 1] * 5 + 3) % vocab
    tokens = tokens.to(device)

    configs = [
        ("dense (plain DDP, no hook)", None),
        ("hook, dense plan", Plan()),
        ("hook, powersgd r=2", Plan.uniform("powersgd", rank=2)),
        ("hook, topk 1%", Plan.uniform("topk", ratio=0.01)),
        ("hook, int8", Plan.uniform("int8")),
        ("hook, int4", Plan.uniform("int4")),
        ("hook, bf16", Plan.uniform("bf16")),
        ("hook, int4, raycomp.bucket_cap_mb buckets", Plan.uniform("int4")),
        ("plain DDP, fp16 autocast + GradScaler", None),
        ("hook, topk 1%, fp16 autocast + GradScaler", Plan.uniform("topk", ratio=0.01)),
    ]
    rows = []
    for label, plan in configs:
        if only and only not in label:
            continue
        def run(label: str = label, plan: Plan | None = plan) -> str:
            torch.manual_seed(0)
            model = char_transformer(vocab, block=block).to(device)
            buckets = {"bucket_cap_mb": bucket_cap_mb(model)} if "bucket_cap_mb" in label else {}
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **buckets)
            amp = "fp16 autocast" in label
            scaler = torch.amp.GradScaler(device.type) if amp else None
            state = None
            if plan is not None:
                state = CompressionState(ddp, plan, grad_scaler=scaler)
                ddp.register_comm_hook(state, compression_hook)
            opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
            gen = torch.Generator().manual_seed(1)
            losses, times = [], []
            for _ in range(steps):
                offsets = torch.randint(0, n_tokens - block - 1, (batch,), generator=gen).to(device)
                idx = offsets[:, None] + torch.arange(block + 1, device=device)
                window = tokens[idx]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                    loss = lm_loss(ddp(window[:, :-1]), window[:, 1:])
                opt.zero_grad()
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
            if state is not None:
                state.close()
            first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
            ms = statistics.median(times[5:]) * 1e3
            rows.append({"run": label, "loss_first5": first, "loss_last5": last, "ms_per_step": ms})
            assert all(math.isfinite(v) for v in losses), "non-finite loss"
            assert last < first, f"loss did not decrease ({first:.3f} -> {last:.3f})"
            return f"loss {first:.3f} -> {last:.3f}, {ms:.2f} ms/step (median)"

        guarded(f"train/{label}", run)
    return rows


# --- 4. gloo, two ranks, CUDA tensors ----------------------------------------------------------


_SINK: list[str] = []  # in a gloo worker: the file its results go to, after every check


def _gloo_worker(rank: int, world: int, port: int, device_type: str, outdir: str, part: str,
                 options: dict[str, Any]) -> None:
    import faulthandler

    faulthandler.enable()  # a crash inside a collective prints the Python stack
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _SINK.append(os.path.join(outdir, f"{part}-rank{rank}.json"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with open(os.path.join(outdir, f"{part}-rank{rank}.started"), "w"):
        pass  # the group is up: a later death is the checks', not the start's
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    prefix = f"gloo-w{world}-{device.type}"

    def op(name: str, fn: Callable[[], None]) -> None:
        guarded(f"{prefix}/op/{name}", lambda: (fn(), "")[1])

    t = torch.arange(8, dtype=torch.float32, device=device) + rank
    if part == "main":
        op("all_reduce", lambda: dist.all_reduce(t.clone()))
        op("broadcast", lambda: dist.broadcast(t.clone(), 0))
        op("all_gather", lambda: dist.all_gather([torch.empty_like(t) for _ in range(world)], t))
        op("all_gather uint8", lambda: dist.all_gather(
            [torch.empty(5, dtype=torch.uint8, device=device) for _ in range(world)],
            torch.ones(5, dtype=torch.uint8, device=device)))
        op("all_to_all_single", lambda: dist.all_to_all_single(
            torch.empty(8, device=device), t, [4] * world, [4] * world))
        reducer_checks(device, prefix, rank, world)
        ddp_checks(device, prefix, rank, world, steps=3)
        unused_layer_checks(device, prefix, rank, world)
        compiled_ddp_checks(device, prefix, rank, world)
        loss_scale_checks(device, prefix, rank, world)
        control_checks(device, prefix, rank, world)
        ladder_checks(device, prefix, rank, world)
        sharded_comm_checks(device, prefix, rank, world)
    elif part == "buckets":
        bucket_checks(device, prefix, rank, world)
    elif part.startswith("probe"):  # one collective FSDP2 itself needs from the backend
        name = list(PROBES)[int(part.removeprefix("probe"))]
        op(name, lambda: PROBES[name](t, world))
    else:
        sharded_fsdp_checks(device, prefix, rank, world, **options)
        sharded_state_checks(device, prefix, rank, world, options.get("own_all_gather", False))
    dist.barrier()
    dist.destroy_process_group()


def _probe_full_tensor(t: torch.Tensor, world: int) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(t.device.type, (world,))
    return DTensor.from_local(t, mesh, [Shard(0)]).full_tensor()


PROBE_AG = "all_gather_into_tensor (FSDP2's all-gather)"
PROBE_RS = "reduce_scatter_tensor (FSDP2's own reduce-scatter)"
PROBES: dict[str, Callable[[torch.Tensor, int], Any]] = {
    PROBE_AG: lambda t, world: dist.all_gather_into_tensor(torch.empty(world * t.numel(), device=t.device), t),
    PROBE_RS: lambda t, world: dist.reduce_scatter_tensor(torch.empty(t.numel() // world, device=t.device),
                                                          t.clone()),
    # the checks gather full tensors with the list all_gather instead (see _full)
    "DTensor.full_tensor() (functional all-gather; not used by raycomp)": _probe_full_tensor,
}


def _spawn(device: torch.device, outdir: str, part: str, options: dict[str, Any] | None = None) -> str:
    """Run one part of the gloo checks on two processes; '' or how the spawn failed. A
    spawn whose process group never came up is tried once more (on a fresh port)."""
    import torch.multiprocessing as mp

    for attempt in (1, 2):
        try:
            mp.spawn(_gloo_worker, args=(2, free_port(), device.type, outdir, part, options or {}),
                     nprocs=2, join=True)
            return ""
        except Exception as error:  # noqa: BLE001
            text = f"{type(error).__name__}: {error}"
            print(f"spawn {part} (attempt {attempt}) failed: {text}", flush=True)
            started = all(os.path.exists(os.path.join(outdir, f"{part}-rank{r}.started")) for r in (0, 1))
            if started or attempt == 2:
                last = [line.strip() for line in text.strip().splitlines() if line.strip()][-1]
                kind = "" if last.startswith(type(error).__name__) else f"{type(error).__name__}: "
                return (f"{kind}{last[:300]}"
                        + ("" if started else " (the process group did not come up, twice)"))
    return ""


def _collect(outdir: str, part: str) -> list[dict[str, Any]]:
    """Rank 0's results of one part, and rank 1's failures."""
    rows = []
    for rank in (0, 1):
        path = os.path.join(outdir, f"{part}-rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                for r in json.load(f):
                    if rank == 0 or r.get("status") == "FAIL":
                        rows.append({**r, "check": r["check"] + ("" if rank == 0 else " (rank1)")})
    return rows


def gloo_two_ranks(device: torch.device, skip: set[str]) -> None:
    """Separate spawns, so that a crash in one (a segfault in a collective, say) costs only
    its own checks: the main checks, the buckets and streams, one probe per collective
    FSDP2 needs, then FSDP2 (with a stand-in all-gather if the backend failed the
    all-gather probe). ``skip`` takes the sections' names, as for NCCL."""
    prefix = f"gloo-w2-{device.type}"
    with tempfile.TemporaryDirectory() as outdir:
        for part, section in (("main", "reducer"), ("buckets", "buckets")):
            if section in skip:
                continue
            failed = _spawn(device, outdir, part)
            RESULTS.extend(_collect(outdir, part))
            if failed:
                record(f"{prefix}/spawn({part})", False, failed)
        if "sharded" in skip:
            return

        broken: dict[str, str] = {}
        for i, name in enumerate(PROBES):  # one spawn each: a crash must not hide the next probe
            failed = _spawn(device, outdir, f"probe{i}")
            probed = _collect(outdir, f"probe{i}")
            RESULTS.extend(probed)
            if failed and not probed:
                record(f"{prefix}/op/{name}", False, f"the process died in it: {failed}")
            if failed or any(r["status"] == "FAIL" for r in probed):
                broken[name] = failed or next(r["note"] for r in probed if r["status"] == "FAIL")
        options: dict[str, Any] = {"own_all_gather": PROBE_AG in broken}
        if PROBE_RS in broken:
            options["plain_reason"] = f"gloo, {device.type} tensors: reduce_scatter_tensor: {broken[PROBE_RS]}"
        failed = _spawn(device, outdir, "fsdp", options)
        RESULTS.extend(_collect(outdir, "fsdp"))
        if failed:
            record(f"{prefix}/spawn(fsdp)", False, failed)


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma list of sections to skip: compressors, nccl, "
                    "reducer, buckets, sharded, train, gloo (reducer, buckets and sharded apply to gloo too)")
    ap.add_argument("--train-only", default="", help="train only the runs whose label has this")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    skip = set(filter(None, args.skip.split(",")))
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    print(json.dumps(info), flush=True)

    bench: list[dict[str, Any]] = []
    if "compressors" not in skip:
        guarded(f"bitpack/{device.type}", lambda: check_bitpack(device))
        guarded(f"payload-pack/{device.type}", lambda: check_payload_pack(device))
        for name in COMPRESSORS:
            guarded(f"compressor/{name}", lambda name=name: check_compressor(name, device, info))
        for name in COMPRESSORS:
            try:
                bench.append(sync_and_speed(name, device, args.quick))
                print(json.dumps(bench[-1]), flush=True)
            except Exception as error:  # noqa: BLE001
                record(f"bench/{name}", False, f"{type(error).__name__}: {error}")

    train_rows: list[dict[str, Any]] = []
    if "nccl" not in skip:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        prefix = f"{backend}-w1-{device.type}"
        if "reducer" not in skip:
            if device.type == "cuda":
                nccl_cpu_tensor_demo(prefix)
            reducer_checks(device, prefix, 0, 1)
            ddp_checks(device, prefix, 0, 1)
            unused_layer_checks(device, prefix, 0, 1)
            compiled_ddp_checks(device, prefix, 0, 1)
            guarded(f"{prefix}/timeout_of a new group", lambda: group_timeout_check(device))
            loss_scale_checks(device, prefix, 0, 1)
            checkpoint_to_cpu_resume(device, prefix)
            checkpoint_to_cpu_resume_whole(device, prefix)
            control_checks(device, prefix, 0, 1)
            ladder_checks(device, prefix, 0, 1)
        if "buckets" not in skip:
            bucket_checks(device, prefix, 0, 1)
            if device.type == "cuda":
                guarded("cpu-run/hook threads on a CUDA machine", cpu_run_on_a_cuda_machine)
        if "sharded" not in skip:
            sharded_comm_checks(device, prefix, 0, 1)
            sharded_fsdp_checks(device, prefix, 0, 1)
            sharded_state_checks(device, prefix, 0, 1)
        if "train" not in skip:
            train_rows = training_runs(device, args.quick, args.train_only)
        dist.destroy_process_group()
    if "gloo" not in skip:
        gloo_two_ranks(device, skip)

    print("\n==== SUMMARY ====")
    width = max(len(r["check"]) for r in RESULTS)
    for r in RESULTS:
        print(f"{r['status']}  {r['check']:<{width}}  {r['note']}")
    counts = {k: sum(r["status"] == k for r in RESULTS) for k in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    info["counts"] = counts
    if bench:
        print("\ncompressor | syncs c/d | HtoD/DtoH/item/nonzero (c+d, 1M) | 16M compress ms | decompress ms | GB/s")
        for b in bench:
            cp = b.get("copies", {})
            print(f"{b['compressor']} | {b.get('syncs_compress', '-')}/{b.get('syncs_decompress', '-')} "
                  f"[{b.get('sync_sites', '')}] | "
                  f"{cp.get('HtoD', '-')}/{cp.get('DtoH', '-')}/{cp.get('local_scalar', '-')}/"
                  f"{cp.get('nonzero', '-')} | {b['compress_ms']:.3f} | {b['decompress_ms']:.3f} | "
                  f"{b['compress_gbps']:.1f}")
    for row in train_rows:
        print(json.dumps(row))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"info": info, "results": RESULTS, "bench": bench, "train": train_rows}, f, indent=1)


if __name__ == "__main__":
    main()
