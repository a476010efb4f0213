"""The per-step guard on real gloo processes: every rank takes the same decision from what
it already holds after the gradient collectives, with no collective of its own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp._internal.guard import Guard
from raycomp._internal.train.step_judge import StepJudge
from tests.distributed import run_distributed

NAN_STEP = 3


def _guarded_steps(rank: int, world_size: int, plan: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: control rides with the last one
    state = CompressionState(ddp, Plan.from_dict(plan), min_compress_numel=0, async_comm=False)
    ddp.register_comm_hook(state, compression_hook)
    guard = StepJudge(Guard(stable_steps=100, loss_window=3), state, rank, world_size)
    calls = {"n": 0}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    out = []
    for step in range(6):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if step == NAN_STEP and rank == 1:
            loss = loss * float("nan")  # only this rank's gradients are poisoned
        loss.backward()
        for name in originals:
            setattr(dist, name, counted(originals[name]))
        try:
            verdict = guard.decide(step, list(model.parameters()))
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        guard.stage(float(loss.detach()), not verdict.skip_update)
        if verdict.skip_update:
            state.discard_step()
        residuals = state.memory.state_dict().get("residuals", {})
        out.append((verdict.skip_update, guard.guard.active, guard.guard.reason,
                    all(torch.isfinite(r).all() for r in residuals.values())))
        ddp.zero_grad()
    state.close()
    return out, calls["n"]


def test_one_rank_nan_skips_the_same_step_everywhere_without_a_control_collective():
    # topk: the compressed mean need not carry the NaN; the flag in the control rows must
    for plan in (Plan.uniform("topk", ratio=0.1), Plan()):
        results = run_distributed(_guarded_steps, 2, plan.to_dict())
        (rank0, calls0), (rank1, calls1) = results
        assert rank0 == rank1, "ranks decided differently"
        assert calls0 == calls1 == 0, "the guard issued a collective of its own"
        skips = [s for s, (skip, *_) in enumerate(rank0) if skip]
        assert skips == [NAN_STEP]
        # a compressed plan falls back; a dense one trains as plain DDP: the step is skipped
        # (as torch's GradScaler skips it) and there is nothing to fall back to
        assert rank0[NAN_STEP][1:3] == ((False, "") if plan.trains_as_ddp else (True, "nonfinite_gradient"))
        assert all(finite for *_, finite in rank0), "a NaN reached the error-feedback memory"


def test_a_torch_baseline_factory_refuses_none_and_the_other_strategy():
    from jobs.baselines import torch_baseline
    from jobs.config import BenchmarkSection
    from raycomp.train import TrainOptions
    from raycomp.train.gradient_strategy import StrategySetup

    with pytest.raises(ValueError, match=r"^benchmark\.baseline: must be one of torch_allreduce, .*got 'none'$"):
        torch_baseline(BenchmarkSection())
    build = torch_baseline(BenchmarkSection(baseline="torch_fsdp"))
    with pytest.raises(ValueError, match=r"^benchmark\.baseline: 'torch_fsdp' does not fit strategy 'ddp'; "
                                         r"allowed there: torch_allreduce, torch_fp16, "):
        build(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
              StrategySetup(TrainOptions(), torch.device("cpu")))
