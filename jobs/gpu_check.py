"""GPU checks for the compressors, the reducer, the DDP hook and a short training run.

Run on a machine with a CUDA device (no Ray, no pydantic needed)::

    PYTHONUNBUFFERED=1 python -m jobs.gpu_check --out $OUT

It prints a PASS/FAIL table and writes ``results.json`` (and the same table) under
``--out``. ``--device cpu --quick`` runs the same logic on CPU with gloo (to check the
script itself; sync counts and CUDA timings are then skipped). Findings are written up in
``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
    "powersgd": {"rank": 2},
}
BENCH_PARAMS = {**PARAMS, "randomk": {"ratio": 0.01}, "threshold": {"threshold": 2.576},
                "powersgd": {"rank": 4}}
DETERMINISTIC = {"none", "fp16", "bf16", "topk", "threshold", "sign", "int8", "powersgd"}
SHAPES = [(1000,), (64, 33), (8, 4, 3, 3), (257, 129)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

RESULTS: list[dict[str, Any]] = []


def record(check: str, ok: bool, note: str = "") -> None:
    RESULTS.append({"check": check, "ok": bool(ok), "note": note})
    print(f"[{'PASS' if ok else 'FAIL'}] {check}{': ' + note if note else ''}", flush=True)


def guarded(check: str, fn: Callable[[], str | None]) -> None:
    try:
        note = fn()
        record(check, True, note or "")
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
    "scalable-int8": "int8", "scalable-qsgd": "qsgd", "scalable-sign": "sign",
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
            if world > 1:
                gathered = [torch.empty_like(means[0]) for _ in range(world)]
                dist.all_gather(gathered, means[0])
                assert all(torch.equal(gathered[0], t) for t in gathered), "ranks disagree on the mean"
                if name in ("none", "fp16"):
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
            if world > 1:
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                gathered = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(gathered, flat)
                assert all(torch.equal(gathered[0], t) for t in gathered), "parameters diverged across ranks"
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


# --- 3. training -----------------------------------------------------------------------


def training_runs(device: torch.device, quick: bool, only: str = "") -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raycomp.hook import CompressionState, compression_hook
    from raycomp.models import char_transformer, lm_loss

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
    ]
    rows = []
    for label, plan in configs:
        if only and only not in label:
            continue
        def run(label: str = label, plan: Plan | None = plan) -> str:
            torch.manual_seed(0)
            model = char_transformer(vocab, block=block).to(device)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            state = None
            if plan is not None:
                state = CompressionState(ddp, plan)
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
                loss = lm_loss(ddp(window[:, :-1]), window[:, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
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


def _gloo_worker(rank: int, world: int, port: int, device_type: str, outdir: str) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    prefix = f"gloo-w{world}-{device.type}"

    def op(name: str, fn: Callable[[], None]) -> None:
        guarded(f"{prefix}/op/{name}", lambda: (fn(), "")[1])

    t = torch.arange(8, dtype=torch.float32, device=device) + rank
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
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(RESULTS, f)
    dist.barrier()
    dist.destroy_process_group()


def gloo_two_ranks(device: torch.device) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.spawn(_gloo_worker, args=(2, free_port(), device.type, outdir), nprocs=2, join=True)
        except Exception as error:  # noqa: BLE001
            record(f"gloo-w2-{device.type}/spawn", False, f"{type(error).__name__}: {str(error)[:400]}")
        for rank in (0, 1):
            path = os.path.join(outdir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    for r in json.load(f):
                        if rank == 0 or not r["ok"]:
                            RESULTS.append({**r, "check": r["check"] + ("" if rank == 0 else " (rank1)")})


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--train-only", default="", help="train only the runs whose label has this")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    skip = set(filter(None, args.skip.split(",")))
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
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
            checkpoint_to_cpu_resume(device, prefix)
            checkpoint_to_cpu_resume_whole(device, prefix)
        if "train" not in skip:
            train_rows = training_runs(device, args.quick, args.train_only)
        dist.destroy_process_group()
    if "gloo" not in skip:
        gloo_two_ranks(device)

    print("\n==== SUMMARY ====")
    width = max(len(r["check"]) for r in RESULTS)
    for r in RESULTS:
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['check']:<{width}}  {r['note']}")
    print(f"{sum(r['ok'] for r in RESULTS)} passed, {sum(not r['ok'] for r in RESULTS)} failed")
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
