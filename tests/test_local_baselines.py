"""The local-step baselines of the benchmark on real gloo processes: torch's post-local SGD
(``jobs/postlocal_sgd.py``), torchft's DiLoCo (``jobs/torchft_diloco.py``) and the guard's
agreement when ranks keep their own gradients (``jobs/baseline_guard.py``); their config errors."""

from __future__ import annotations

import copy
import importlib.util
import math
from typing import Any

import pytest
import torch

from jobs.config import BenchmarkSection, ConfigError, validate
from tests.distributed import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def _flat(module: torch.nn.Module, grads: bool = False) -> torch.Tensor:
    return torch.cat([(p.grad if grads else p).detach().reshape(-1).clone() for p in module.parameters()])


# --- torch's post-local SGD --------------------------------------------------------------------
def _post_local_sgd_steps(rank: int, world: int, period: int, start: int, steps: int) -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from jobs.postlocal_sgd import PostLocalSgdStrategy, register_post_local_sgd

    model = _model()
    ddp = DDP(model)
    benchmark = BenchmarkSection(baseline="torch_postlocalsgd", localsgd_period=period, localsgd_start_iter=start)
    sync = PostLocalSgdStrategy(ddp, None, register_post_local_sgd(ddp, benchmark))  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        reference = copy.deepcopy(model)  # this rank's own gradient, computed without DDP
        reference(_batch(step, rank)).square().mean().backward()
        optimizer.zero_grad()
        ddp(_batch(step, rank)).square().mean().backward()
        record = {"grad": _flat(model, grads=True), "own": _flat(reference, grads=True)}
        optimizer.step()
        sync.after_optimizer_step(True, 0.0)
        out.append({**record, "params": _flat(model)})
    return out


def test_post_local_sgd_all_reduces_for_the_warmup_then_only_averages_every_h_steps():
    period, start, steps = 3, 2, 9
    ranks = run_distributed(_post_local_sgd_steps, 2, period, start, steps)
    for step, (a, b) in enumerate(zip(*ranks, strict=True)):
        if step < start:  # DDP: the mean gradient, the same on both ranks, not either rank's own
            assert torch.allclose(a["grad"], b["grad"], rtol=1e-6, atol=1e-7), step
            assert not torch.allclose(a["grad"], a["own"], rtol=1e-3, atol=1e-5), step
        else:  # local SGD: no gradient crosses between the ranks
            assert torch.equal(a["grad"], a["own"]) and torch.equal(b["grad"], b["own"]), step
            assert not torch.allclose(a["grad"], b["grad"], rtol=1e-3, atol=1e-5), step
        averaged = step < start or (step - start) % period == 0  # PeriodicModelAverager after steps 2, 5, 8
        assert torch.allclose(a["params"], b["params"], rtol=1e-6, atol=1e-7) == averaged, step
    # the average is the mean of what the ranks held: replicas that drifted apart meet again
    assert not torch.allclose(ranks[0][4]["params"], ranks[1][4]["params"])
    assert torch.allclose(ranks[0][5]["params"], ranks[1][5]["params"], rtol=1e-6, atol=1e-7)


def _two_level_post_local_sgd(rank: int, world: int, period: int, start: int, steps: int) -> list[dict[str, Any]]:
    """2 nodes x 2 ranks: torch's two-level recipe, the node's group as the hook's subgroup."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from jobs.postlocal_sgd import PostLocalSgdStrategy, register_post_local_sgd
    from raycomp._internal.topology import Topology, node_groups

    levels = node_groups(Topology.of_rank(rank, 2, 2))
    model = _model()
    ddp = DDP(model)
    benchmark = BenchmarkSection(baseline="torch_postlocalsgd", localsgd_period=period, localsgd_start_iter=start)
    sync = PostLocalSgdStrategy(ddp, None, register_post_local_sgd(ddp, benchmark, levels.intra.handle))  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        optimizer.zero_grad()
        ddp(_batch(step, rank)).square().mean().backward()
        grad = _flat(model, grads=True)
        optimizer.step()
        sync.after_optimizer_step(True, 0.0)
        out.append({"grad": grad, "params": _flat(model)})
    return out


def test_two_level_post_local_sgd_reduces_inside_the_node_every_step_and_averages_every_h():
    period, start, steps = 3, 2, 8
    ranks = run_distributed(_two_level_post_local_sgd, 4, period, start, steps)
    for step in range(steps):
        grads, params = [r[step]["grad"] for r in ranks], [r[step]["params"] for r in ranks]
        assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-7), step  # node 0's mean
        assert torch.allclose(grads[2], grads[3], rtol=1e-6, atol=1e-7), step  # node 1's
        across = torch.allclose(grads[0], grads[2], rtol=1e-3, atol=1e-5)
        assert across == (step < start), step  # all four ranks' mean only in the warm-up
        averaged = step < start or (step - start) % period == 0
        assert all(torch.allclose(p, params[0], rtol=1e-6, atol=1e-7) for p in params) == averaged, step


# --- the guard's agreement -------------------------------------------------------------------
def _guard_decisions(rank: int, world: int) -> list[tuple[bool, float, list[list[float]]]]:
    from jobs.baseline_guard import BaselineGuardState
    from raycomp._internal.ddp.hook import CompressionState
    from raycomp._internal.guard import Guard
    from raycomp._internal.train.step_judge import StepJudge
    from raycomp.plan import Plan

    model = _model()
    state = BaselineGuardState(CompressionState(model, Plan()), rank, world)
    guard = StepJudge(Guard(), state, rank, world)
    out = []
    for step in range(8):
        scale = 1.0 + rank  # the ranks' gradients differ, as under local steps
        if step == 6 and rank == 1:
            scale = 1000.0  # an explosion on rank 1 only
        if step == 7 and rank == 0:
            scale = math.nan  # a non-finite gradient on rank 0 only
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)
        verdict = guard.decide(step, list(model.parameters()))
        rows = state.control_rows
        norm = state.inner.gradient_norm(list(model.parameters()))
        guard.stage(loss=float(step + rank), applied=not verdict.skip_update)
        out.append((verdict.skip_update, norm, rows))
    state.close()
    return out


def test_ranks_with_their_own_gradients_take_the_same_guard_decision():
    ranks = run_distributed(_guard_decisions, 2)
    skips = [[s for s, _, _ in r] for r in ranks]
    # rank 0's NaN at step 7 skips the step on both ranks; rank 1's explosion at step 6 does
    # on neither: a baseline's plan is raycomp's dense one, whose steps the guard leaves as
    # the baseline takes them (only a non-finite gradient is skipped)
    assert skips[0] == skips[1] == [False] * 7 + [True]


def test_the_guard_sees_the_largest_local_norm_and_every_rank_s_control_row():
    from jobs.baseline_guard import BaselineGuardState
    from raycomp._internal.ddp.hook import CompressionState
    from raycomp.plan import Plan

    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    state = BaselineGuardState(CompressionState(model, Plan()), rank=0, world_size=1)
    state.stage_control([1.5, 1.0, 0.25])
    expected = 2.0 * math.sqrt(sum(p.numel() for p in model.parameters()))
    assert state.gradient_norm(list(model.parameters())) == pytest.approx(expected)
    assert state.control_rows.tolist() == [[0.0, 1.5, 1.0, 0.25]]  # flag, then the staged values
    next(model.parameters()).grad[0, 0] = math.inf
    assert math.isnan(state.gradient_norm(list(model.parameters())))
    assert state.control_rows.tolist()[0][0] == 1.0
    state.close()


# --- torchft's DiLoCo --------------------------------------------------------------------------
def _diloco_steps(rank: int, world: int, sync_every: int, steps: int) -> list[torch.Tensor]:
    from jobs.torchft_diloco import DilocoReplica

    torch.manual_seed(rank)  # different initial weights: the replica takes rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replica = DilocoReplica(model, optimizer, BenchmarkSection(baseline="torchft_diloco", diloco_sync_every=sync_every),
                            "127.0.0.1", rank, world, timeout_s=30)
    out = [_flat(model)]
    try:
        for step in range(steps):
            optimizer.zero_grad()
            model(_batch(step, rank)).square().mean().backward()
            optimizer.step()  # DiLoCo's hook syncs after every sync_every-th step
            out.append(_flat(model))
        assert replica.syncs() == steps // sync_every
    finally:
        replica.close()
    return out


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
def test_torchft_diloco_syncs_the_replicas_every_h_steps_on_gloo():
    ranks = run_distributed(_diloco_steps, 2, 3, 6, timeout=180)
    for step, (a, b) in enumerate(zip(*ranks, strict=True)):
        # equal at the start (rank 0's weights) and after each sync (steps 3 and 6), apart between
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7) == (step % 3 == 0), step


# --- config errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(("benchmark", "message"), [
    ({"localsgd_period": 1}, r"^benchmark\.localsgd_period: Input should be greater than or equal to 2 \(got 1\)$"),
    ({"localsgd_start_iter": -1}, r"^benchmark\.localsgd_start_iter: Input should be greater than or equal to 0"),
    ({"diloco_sync_every": 0}, r"^benchmark\.diloco_sync_every: Input should be greater than or equal to 1"),
    ({"diloco_outer_momentum": 1.0}, r"^benchmark\.diloco_outer_momentum: Input should be less than 1"),
    ({"diloco_outer_lr": 0}, r"^benchmark\.diloco_outer_lr: Input should be greater than 0"),
    ({"baseline": "torch_localsgd"}, r"^benchmark\.baseline: must be one of .*'torch_postlocalsgd', 'torchft_diloco'"),
])
def test_bad_local_step_settings_are_one_line_errors(benchmark, message):
    with pytest.raises(ConfigError, match=message):
        validate({"benchmark": benchmark})


def test_local_step_baselines_are_ddp_strategy_only():
    with pytest.raises(ConfigError, match=r"^benchmark\.baseline: 'torch_postlocalsgd' is a DDP hook; allowed with "
                                          r"scaling\.strategy=fsdp: none, torch_fsdp, torch_fsdp_bf16, torch_hsdp$"):
        validate({"scaling": {"strategy": "fsdp"}, "benchmark": {"baseline": "torch_postlocalsgd"}})
