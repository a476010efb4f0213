"""The hook's production path on the KJV transformer: ``raycomp.bucket_cap_mb``'s buckets,
the hook's background threads, and forward and backward on the caller's own CUDA stream.

These are the only tests of three CUDA-only lines of ``CompressionState.submit``: the
CUDA future, the threads running under the caller's stream, and no stream context off CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp._internal.ddp.buckets import bucket_cap_mb
from raycomp._internal.ddp.hook import CompressionState, compression_hook
from raycomp.plan import Plan
from tests.gpu.models import kjv_transformer
from tests.gpu.ranks import Check, Nccl, TwoRanks
from tests.gpu.support import count_syncs, free_port, same, same_on_every_rank

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
PLANS = {"int4": Plan.uniform("int4"), "dense": Plan()}


def _hook_means(device: torch.device, rank: int, plan: Plan, *, auto: bool, async_comm: bool,
                side_stream: str = "", steps: int = 2) -> tuple[list[int], list[torch.Tensor], int]:
    """The bucket sizes DDP hands the hook at the last step (DDP rebuilds its buckets after
    the first), every parameter's mean gradient after it, and the syncs of the last step.

    ``side_stream``: forward and backward run on a stream of their own, and backward starts
    with ~0.1 s of GPU sleep, so every gradient is written well after the hook is called;
    work on another stream reads the buckets too early, or DDP copies the means into
    ``.grad`` before they are decoded. ``"train"``: only the steps run on it (autograd then
    hands DDP the gradients on the default stream, where DDP built its gradient
    accumulators); ``"all"``: the model and DDP are built on it as well."""
    side = torch.cuda.Stream(device) if side_stream else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side if side_stream == "all" else None):
        model = kjv_transformer(device)
        ddp = DDP(model, device_ids=[device.index], **({"bucket_cap_mb": bucket_cap_mb(model)} if auto else {}))
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

        if step == steps - 1 and side is None:
            syncs, _ = count_syncs(one_step)
        else:
            one_step()
    state.close()
    torch.cuda.synchronize(device)
    return sizes, [p.grad.detach().clone() for p in model.parameters()], syncs


def buckets(device: torch.device, rank: int, world: int) -> str:
    """``bucket_cap_mb``'s buckets (about eight) against DDP's default (two), with and
    without the hook's threads: int4 is deterministic, so all four give the same means
    bit for bit."""
    runs = {(auto, async_comm): _hook_means(device, rank, PLANS["int4"], auto=auto, async_comm=async_comm)
            for auto in (True, False) for async_comm in (True, False)}
    sizes_auto, sizes_ddp = runs[True, True][0], runs[False, True][0]
    assert 6 <= len(sizes_auto) <= 16, f"auto: {len(sizes_auto)} buckets {sizes_auto}"
    assert len(sizes_ddp) <= 3, f"DDP's default: {len(sizes_ddp)} buckets"
    ref = runs[False, False][1]
    for key, (_, means, _) in runs.items():
        diff = same(ref, means)
        assert not diff, f"auto={key[0]}, async={key[1]}: means {diff} from DDP's default buckets inline"
    assert same_on_every_rank(ref), "ranks disagree on the means"
    return (f"{len(sizes_auto)} buckets with auto, {len(sizes_ddp)} with DDP's default; syncs/step: "
            + ", ".join(f"{'auto' if a else 'ddp'}/{'async' if t else 'inline'}={runs[a, t][2]}" for a, t in runs))


def caller_stream(device: torch.device, rank: int, world: int, plan: str, async_comm: bool) -> str:
    """The steps, and then the model, DDP and the steps, on a stream of their own: the
    means are the default stream's, bit for bit."""
    _, ref, _ = _hook_means(device, rank, PLANS[plan], auto=True, async_comm=async_comm)
    for where in ("train", "all"):
        _, means, _ = _hook_means(device, rank, PLANS[plan], auto=True, async_comm=async_comm, side_stream=where)
        diff = same(ref, means)
        assert not diff, f"{where} on the caller's stream: means {diff} from the default stream's"
    return ""


BUCKETS = Check(buckets)
STREAMS = {(p, a): Check(caller_stream, {"plan": p, "async_comm": a}) for p in PLANS for a in (True, False)}
TWO_RANKS = [BUCKETS, *STREAMS.values()]


def test_hook_means_do_not_depend_on_buckets_or_threads(ranks: Nccl | TwoRanks, note: Callable[[str], None]) -> None:
    note(ranks.run(BUCKETS))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("async_comm", [True, False], ids=["threads", "inline"])
def test_hook_on_the_callers_cuda_stream(ranks: Nccl | TwoRanks, plan: str, async_comm: bool) -> None:
    ranks.run(STREAMS[plan, async_comm])


CPU_RUN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from raycomp._internal.ddp.hook import CompressionState, compression_hook
from raycomp.plan import Plan
from tests.gpu.models import kjv_transformer
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
model = kjv_transformer(torch.device("cpu"))
ddp = DDP(model)
state = CompressionState(ddp, Plan.uniform("%s"), async_comm=True)
ddp.register_comm_hook(state, compression_hook)
ddp(torch.randint(0, 63, (2, 128))).logsumexp(-1).mean().backward()
state.close()
print("cuda initialised:", torch.cuda.is_initialized())
"""


@pytest.mark.parametrize("plan", ["int4", "none"])
def test_a_cpu_run_of_the_hook_leaves_cuda_uninitialised(plan: str) -> None:
    """On a machine with CUDA, the hook's threads in a CPU run must not initialise it (a
    forked worker that did would fail; ``torch.cuda.stream`` does, even with ``None``). The
    dense plan takes the plain step (``CompressionState.plain_in_hook``), int4 the threads."""
    out = subprocess.run([sys.executable, "-c", CPU_RUN % (free_port(), plan)], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-400:]
    assert "cuda initialised: False" in out.stdout, out.stdout[-200:]
