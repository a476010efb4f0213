"""The DDP comm hook on real gloo processes, and the same reduction without DDP."""

from __future__ import annotations

import math
import threading
import time
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import (
    CompressionState,
    CompressorSpec,
    Plan,
    bucket_cap_mb,
    compression_hook,
)
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.wire.payload import Payload
from raycomp.compressors import Compressor, Transport
from raycomp.compressors.minmax import MinMaxInt8
from tests.distributed import run_distributed


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)).to(dtype)


def _batch(rank: int, step: int = 0, n: int = 16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 32, generator=gen).to(dtype), torch.randint(0, 10, (n,), generator=gen)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _backward(model, rank, step=0, dtype=torch.float32):
    x, y = _batch(rank, step, dtype=dtype)
    nn.functional.cross_entropy(model(x).float(), y).backward()


# small bucket cap: several buckets, so the hook's per-bucket path and step boundary run
DDP_KW = {"bucket_cap_mb": 0.01}


def _dense_vs_plain_ddp(rank: int, world_size: int):
    plain = DDP(_model(), **DDP_KW)
    hooked = DDP(_model(), **DDP_KW)
    state = CompressionState(hooked, Plan(), min_compress_numel=0)
    hooked.register_comm_hook(state, compression_hook)
    out = []
    for step in range(3):  # buckets are rebuilt after the first iteration
        for m in (plain, hooked):
            m.zero_grad()
            _backward(m, rank, step)
        out.append((_grads(plain), _grads(hooked)))
    state.close()
    return out, state.step


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dense_plan_equals_plain_ddp_bit_for_bit(world_size):
    for out, steps in run_distributed(_dense_vs_plain_ddp, world_size):
        assert steps == 3
        for plain, hooked in out:
            for a, b in zip(plain, hooked, strict=True):
                assert torch.equal(a, b)


# --- a dense step with nothing held or profiled reduces each bucket as it lies -------------------
def _plain_against_general(rank: int, world_size: int, dtype: torch.dtype = torch.float32):
    plain_model, general_model, measured_model = (DDP(_model(dtype), **DDP_KW) for _ in range(3))
    plain = CompressionState(plain_model, Plan(), min_compress_numel=0)
    # measures every step, with a Top-K error profile, which only the general path takes
    general = CompressionState(general_model, Plan(), min_compress_numel=0, stats_every=1, profile_ratios=(0.1,))
    measured = CompressionState(measured_model, Plan(), min_compress_numel=0, stats_every=1)  # no profile
    trio = ((plain_model, plain), (general_model, general), (measured_model, measured))
    for model, state in trio:
        model.register_comm_hook(state, compression_hook)
    plans = {3: Plan.uniform("int8"), 4: Plan()}  # compressed once: its residual is sent by the next step
    sent: list[tuple[torch.dtype, int]] = []  # each all-reduce at torch.distributed: what it carried
    original = dist.all_reduce

    def recorded(tensor, *args, **kwargs):
        sent.append((tensor.dtype, tensor.numel()))
        return original(tensor, *args, **kwargs)

    out = []
    dist.all_reduce = recorded
    try:
        for step in range(6):
            if step in plans:
                for _, state in trio:
                    state.set_plan(plans[step])
            out.append([_plain_or_general_step(model, state, rank, step, dtype, sent) for model, state in trio])
    finally:
        dist.all_reduce = original
    for _, state in trio:
        state.close()
    return out


def _plain_or_general_step(model, state, rank, step, dtype, sent) -> dict:
    import threading

    state.stage_control([float(rank + 1), float(step)])
    model.zero_grad()
    receivers = {t.ident for t in threading.enumerate() if t.name.startswith("raycomp-receive")}
    sent.clear()
    _backward(model, rank, step, dtype)
    return {"plain": state._plain, "steps": state.step, "grads": _grads(model), "sent": sorted(sent, key=str),
            "rows": state.control_rows.clone(), "wire": dict(state.ledger.wire_bytes),
            "dense": dict(state.ledger.dense_bytes), "memory": sorted(state.memory.residuals),
            "stats": [{**s.to_dict(), "topk_errors": {}} for s in state.stats],
            "receiver_started": any(t.name.startswith("raycomp-receive") and t.ident not in receivers
                                    for t in threading.enumerate())}


# bf16: the control values (fp32) cannot ride in the bucket's all-reduce; they take their own
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_step_with_nothing_held_reduces_each_bucket_as_it_lies_with_the_general_paths_result(dtype):
    for out in run_distributed(_plain_against_general, 2, dtype):
        # steps 0-2 dense; 3 int8 (a residual is kept); 4 dense, sending it; 5 dense again
        assert [plain["plain"] for plain, _, _ in out] == [True, True, True, False, False, True]
        assert not any(general["plain"] for _, general, _ in out)  # a Top-K profile reads the gradients
        assert not out[0][0]["receiver_started"] and out[0][1]["receiver_started"]  # no thread for a plain step
        for step, (plain, general, measured) in enumerate(out):
            # statistics without a profile: measured on the plain path, as the general path measures them
            assert measured["plain"] == plain["plain"] and torch.equal(measured["rows"], general["rows"]), step
            assert measured["stats"] == general["stats"] and len(general["stats"]) == 6, step
            assert measured["wire"] == general["wire"], step
            for a, b in zip(measured["grads"], general["grads"], strict=True):
                assert torch.equal(a, b), step
            assert plain["steps"] == general["steps"] == step + 1  # the last bucket ended the step
            for a, b in zip(plain["grads"], general["grads"], strict=True):
                assert a.dtype == dtype and torch.equal(a, b), step
            assert torch.equal(plain["rows"], general["rows"]), step  # the control values rode along
            assert plain["rows"][:, 1].tolist() == [1.0, 2.0] and plain["rows"][:, 2].tolist() == [step, step]
            assert plain["wire"] == general["wire"] and plain["dense"] == general["dense"], step
            assert plain["sent"] == general["sent"], step  # the same collectives, dtypes and sizes
            assert plain["memory"] == general["memory"], step
        assert out[3][0]["memory"] and not out[4][0]["memory"]


# lossless (or rounding-only) settings of each transport: the mean must be DDP's mean
LOSSLESS = {
    "fp16": (Plan.uniform("fp16"), 2e-3),  # summable all-reduce, half-precision rounding
    "bf16": (Plan.uniform("bf16"), 2e-2),
    "randomk_all": (Plan.uniform("randomk", ratio=1.0), 1e-5),  # summable, every index
    "topk_all": (Plan.uniform("topk", ratio=1.0), 1e-5),  # sparse all-gather, every index
}


def _lossless_vs_plain_ddp(rank: int, world_size: int):
    out = {}
    for key, (plan, _) in LOSSLESS.items():
        plain = DDP(_model(), **DDP_KW)
        hooked = DDP(_model(), **DDP_KW)
        # min_compress_numel=0: no layer is sent dense behind the compressor's back
        state = CompressionState(hooked, plan, min_compress_numel=0)
        hooked.register_comm_hook(state, compression_hook)
        pairs = []
        for step in range(2):
            for m in (plain, hooked):
                m.zero_grad()
                _backward(m, rank, step)
            pairs.append((_grads(plain), _grads(hooked)))
        state.close()
        out[key] = pairs
    return out


def test_lossless_settings_of_every_transport_give_ddps_mean():
    # catches a mean that is off by a factor (summed instead of averaged, divided twice)
    # in any transport: the results are compared with plain DDP, not with the same code
    for per_key in run_distributed(_lossless_vs_plain_ddp, 2):
        for key, pairs in per_key.items():
            tol = LOSSLESS[key][1]
            for plain, hooked in pairs:
                for a, b in zip(plain, hooked, strict=True):
                    torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=key)


def _low_rank_means(rank: int, world_size: int):
    # each rank's gradient is a rank-1 matrix: the mean over 2 ranks has rank 2
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.outer(torch.randn(rows, generator=gen), torch.randn(cols, generator=gen))
             for rows, cols in ((96, 80), (40, 200))]
    reducer = CompressedReducer(Plan.uniform("powersgd", rank=2), min_compress_numel=0)
    means = reducer.reduce(["a", "b"], grads)
    assert reducer.compressor_for("a").name == "powersgd" and reducer.ledger.wire_total > 0
    return grads, means


def test_powersgd_recovers_an_exactly_low_rank_mean_across_ranks():
    # P = mean(M) Q, orthonormalised, spans mean(M)'s columns; P (mean(M)^T P)^T = mean(M)
    per_rank = run_distributed(_low_rank_means, 2)
    for layer in range(2):
        expected = sum(grads[layer] for grads, _ in per_rank) / 2
        for _, means in per_rank:
            torch.testing.assert_close(means[layer], expected, rtol=1e-4, atol=1e-4)


def _hook_vs_plain_list(rank: int, world_size: int, plan: dict):
    plan = Plan.from_dict(plan)
    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(ddp, plan, min_compress_numel=64)
    ddp.register_comm_hook(state, compression_hook)
    local = _model()
    reference = CompressionState(local, plan, min_compress_numel=64, async_comm=False)
    out = []
    for step in range(3):
        ddp.zero_grad()
        local.zero_grad()
        _backward(ddp, rank, step)
        _backward(local, rank, step)
        reference.allreduce_gradients()
        out.append((_grads(ddp), _grads(local)))
    state.close()
    return out, state.ledger.wire_total, reference.ledger.wire_total


@pytest.mark.parametrize(
    "plan",
    [Plan.uniform("topk", ratio=0.05), Plan.uniform("powersgd", rank=2), Plan.uniform("randomk", ratio=0.1)],
    ids=["topk", "powersgd", "randomk"],
)
def test_hook_matches_the_plain_gradient_list_api(plan):
    # same model, data and plan: DDP + hook (bucketed, async) == reduction of .grad lists
    for out, hook_bytes, list_bytes in run_distributed(_hook_vs_plain_list, 2, plan.to_dict()):
        assert hook_bytes == pytest.approx(list_bytes)
        for hooked, listed in out:
            for a, b in zip(hooked, listed, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _no_sync_accumulation(rank: int, world_size: int):
    plan = Plan.uniform("topk", ratio=0.05)
    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(ddp, plan, min_compress_numel=64)
    ddp.register_comm_hook(state, compression_hook)
    with ddp.no_sync():
        _backward(ddp, rank, step=0)
    after_no_sync = state.step
    _backward(ddp, rank, step=1)
    # reference: the same two micro-batches accumulated locally, then one reduction
    local = _model()
    reference = CompressionState(local, plan, min_compress_numel=64, async_comm=False)
    _backward(local, rank, step=0)
    _backward(local, rank, step=1)
    reference.allreduce_gradients()
    state.close()
    return after_no_sync, state.step, _grads(ddp), _grads(local)


def test_gradient_accumulation_under_no_sync():
    for after_no_sync, steps, hooked, reference in run_distributed(_no_sync_accumulation, 2):
        assert after_no_sync == 0 and steps == 1  # no communication inside no_sync
        for a, b in zip(hooked, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Branchy(nn.Module):
    """A model whose middle layer is skipped on some steps (the same steps on every rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.a(x))
        return self.head(torch.relu(self.b(h)) if use_b else h)


def _unused_parameters(rank: int, world_size: int):
    """Each rank's gradients, plain DDP's and the hook's (``find_unused_parameters``). DDP's
    own collective during backward (the used-parameter map, all-reduced after the last
    bucket is handed over) is forced into a different order against the hook's last
    collective on each rank."""
    out = {}
    for label in ("plain", "hooked"):
        ddp = DDP(_Branchy(), **DDP_KW, find_unused_parameters=True)
        if label == "hooked":
            state = CompressionState(ddp, Plan.uniform("topk", ratio=1.0), min_compress_numel=0)
            start = state.start

            def late_start(*args, start=start, **kwargs):  # rank 0: DDP's all-reduce first, then the hook's
                if rank == 0 and kwargs.get("closes_step"):
                    time.sleep(0.3)
                return start(*args, **kwargs)

            def hook(s, bucket):  # rank 1: the hook's collective first, then DDP's
                future = compression_hook(s, bucket)
                if rank == 1 and bucket.is_last():
                    time.sleep(0.3)
                return future

            state.start = late_start
            ddp.register_comm_hook(state, hook)
        grads = []
        for step, use_b in enumerate([True, False, True, False]):
            ddp.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(ddp(x, use_b), y).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in ddp.parameters()])
        if label == "hooked":
            state.close()
        out[label] = grads
    return out


def test_ddp_collectives_during_backward_do_not_collide_with_the_hook():
    # the hook's collectives have a group of their own: on DDP's, this order on the two
    # ranks made gloo fail with a size mismatch (or hang), and plain DDP's reference and the
    # lossless hook's means must agree on the steps that skip a layer too
    for result in run_distributed(_unused_parameters, 2, timeout=90, pg_timeout_s=30):
        for plain, hooked in zip(result["plain"], result["hooked"], strict=True):
            for a, b in zip(plain, hooked, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _residuals_of_a_skipped_layer(rank: int, world_size: int):
    ddp = DDP(_Branchy(), **DDP_KW, find_unused_parameters=True)
    with CompressionState(ddp, Plan.uniform("topk", ratio=0.1), min_compress_numel=0) as state:
        ddp.register_comm_hook(state, compression_hook)
        residuals = []
        # b: used by both ranks, by rank 1 only, by neither, by neither, by both
        for step, use_b in enumerate([True, rank == 1, False, False, True]):
            ddp.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(ddp(x, use_b), y).backward()
            residuals.append(state.memory.residual("b.weight").clone())
    return residuals


def test_a_layer_no_rank_used_keeps_its_error_feedback_residual():
    # DDP drops the mean of a layer that no rank used; what Top-K took from its residual
    # for that mean must stay in the residual, or error feedback loses it for good
    k = math.ceil(0.1 * 64 * 64)
    for rank, residuals in enumerate(run_distributed(_residuals_of_a_skipped_layer, 2)):
        before, after = residuals[0], residuals[1]
        if rank == 0:  # idle here, used by rank 1: this rank's Top-K reached the mean
            assert int((after == 0).sum()) - int((before == 0).sum()) == k
            assert torch.equal(after, before * (after != 0))
        assert torch.equal(residuals[2], residuals[1]) and torch.equal(residuals[3], residuals[1])
        assert not torch.equal(residuals[4], residuals[3])  # used again: sent and refilled


def _uneven_inputs_under_join(rank: int, world_size: int):
    from torch.distributed.algorithms.join import Join

    ddp = DDP(_model(), **DDP_KW, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with CompressionState(ddp, Plan.uniform("topk", ratio=0.1), min_compress_numel=0) as state:
        ddp.register_comm_hook(state, compression_hook)
        with Join([ddp]):  # rank 1 runs out of batches first; DDP shadows its last two steps
            for step in range(5 if rank == 0 else 3):
                optimizer.zero_grad()
                _backward(ddp, rank, step)
                optimizer.step()
    return [p.detach().clone() for p in ddp.parameters()], state.step


def test_uneven_inputs_under_join_with_find_unused_parameters():
    # a joined rank runs the hook outside any backward, where no callback can be queued
    (params0, steps0), (params1, steps1) = run_distributed(_uneven_inputs_under_join, 2)
    assert steps0 == steps1 == 5
    for a, b in zip(params0, params1, strict=True):
        assert torch.equal(a, b)


def test_held_back_updates_nothing_settled_apply_as_sent_at_the_next_step():
    # a joined rank's shadow step runs the hook outside backward, so no callback settles its
    # idle layers: the next step must apply them as sent before compensating, exactly as a
    # reducer that never held anything back
    gen = torch.Generator().manual_seed(0)
    grads = [torch.zeros(32, 32), torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)]
    held, plain = (CompressedReducer(Plan.uniform("topk", ratio=0.1), min_compress_numel=0) for _ in range(2))
    held.defer_unused = True
    plain.reduce(["w"], [torch.randn(32, 32, generator=torch.Generator().manual_seed(1))])
    plain.end_step()
    held.load_state_dict(plain.state_dict())  # a residual to spend on the idle step
    for grad in grads:
        means = [r.reduce(["w"], [grad.clone()])[0] for r in (held, plain)]
        assert torch.equal(*means)
        held.end_step()
        plain.end_step()
    assert torch.equal(held.memory.residual("w"), plain.memory.residual("w"))


def test_a_checkpoint_between_steps_holds_the_held_back_updates():
    # a joined rank checkpointed between its shadow step and its next step: what it saves
    # must be the memory that next step would use, the held-back update applied as sent
    grad = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    held, plain = (CompressedReducer(Plan.uniform("topk", ratio=0.1), min_compress_numel=0) for _ in range(2))
    held.defer_unused = True
    for r in (held, plain):
        r.reduce(["w"], [grad.clone()])
        r.end_step()
        r.reduce(["w"], [torch.zeros(32, 32)])  # idle here: held back by the deferring reducer
        r.end_step()
    assert "w" in held.held_back
    saved = held.state_dict()["memory"]["residuals"]["w"]
    assert torch.equal(saved, plain.memory.residual("w"))


def _compiled_or_eager(rank: int, world_size: int, compiled: bool):
    torch.manual_seed(0)  # 8 buckets of 2.5 MB: DDP under torch.compile splits its graph at each
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(),
                          *[m for _ in range(5) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 10))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb(model))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with CompressionState(ddp, Plan.uniform("topk", ratio=0.05), min_compress_numel=256) as state:
        ddp.register_comm_hook(state, compression_hook)
        # aot_eager: dynamo, AOTAutograd and DDP's graph split without a C++ toolchain
        # (tests/gpu/test_ddp_hook.py compiles with inductor's Triton kernels on a GPU)
        net = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
    from torch._dynamo.utils import counters

    compiled_frames = counters["frames"]["ok"]
    return [p.detach().clone() for p in model.parameters()], state.ledger.wire_total, state.step, compiled_frames


def test_a_compiled_ddp_model_reduces_as_the_eager_one():
    # torch.compile of a DDP model (DDPOptimizer: one graph per bucket; it needs buckets of at
    # least DDP's 1 MB first bucket, raycomp.bucket_cap_mb's floor): the same hook calls
    (eager, compiled) = (run_distributed(_compiled_or_eager, 2, flag, timeout=300) for flag in (False, True))
    for r in range(2):
        assert eager[r][3] == 0 < compiled[r][3]  # dynamo compiled frames in the compiled run only
        assert compiled[r][1:3] == eager[r][1:3] and eager[r][2] == 3
        for a, b in zip(eager[r][0], compiled[r][0], strict=True):
            assert torch.equal(a, b)


def _group_errors(rank: int, world_size: int) -> list[str]:
    errors = []
    ddp = DDP(_Branchy(), **DDP_KW, find_unused_parameters=True)
    with pytest.raises(ValueError, match="DDP's own group") as shared:
        CompressionState(ddp, process_group=ddp.process_group)
    errors.append(str(shared.value))
    first = dist.new_group([0])  # every rank creates it; only rank 0 is in it
    if rank == 0:
        with pytest.raises(ValueError, match="DDP reduces over 1 of the 2 ranks") as subgroup:
            CompressionState(DDP(_Branchy(), process_group=first), Plan())
        errors.append(str(subgroup.value))
    return errors


def test_a_group_the_hook_cannot_use_is_refused_before_any_step():
    for rank, errors in enumerate(run_distributed(_group_errors, 2)):
        assert len(errors) == 2 - rank  # the subgroup case runs on its one member
        assert all("\n" not in e and e.startswith("process_group:") for e in errors)


def _hook_waits_for_an_absent_rank(rank: int, world_size: int):
    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(ddp, Plan.uniform("topk"), min_compress_numel=0)
    ddp.register_comm_hook(state, compression_hook)
    if rank == 1:  # never joins the step, but stays up (an exit would reset the connection)
        time.sleep(6)
        return None
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="Timed out"):
        _backward(ddp, rank)
    return time.perf_counter() - started


def test_a_hook_collective_fails_within_the_process_group_timeout():
    # the hook's own group takes the default group's timeout (2 s here); created with
    # torch's default, gloo would wait 30 minutes
    waited = run_distributed(_hook_waits_for_an_absent_rank, 2, timeout=60, pg_timeout_s=2)[0]
    assert 1.5 < waited < 5


def test_a_sparse_embedding_is_refused_at_construction():
    # DDP would hand its sparse gradient to the hook, which failed deep inside backward
    model = nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"^model: '0' is an Embedding with sparse=True; raycomp reduces dense"):
        CompressionState(model)
    model[0].weight.requires_grad_(False)  # frozen: no gradient to reduce
    CompressionState(model, async_comm=False)
    CompressionState(nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 2)), async_comm=False)


def _bf16(rank: int, world_size: int):
    results = {}
    # 1) fp32 model under bf16 autocast: gradients are fp32
    for name in ("topk", "int8", "powersgd"):
        ddp = DDP(_model(), **DDP_KW)
        state = CompressionState(ddp, Plan.uniform(name), min_compress_numel=64)
        ddp.register_comm_hook(state, compression_hook)
        for step in range(2):
            ddp.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x, y = _batch(rank, step)
                loss = nn.functional.cross_entropy(model_out := ddp(x), y)
            loss.backward()
        state.close()
        results[f"autocast/{name}"] = (model_out.dtype, _grads(ddp))
    # 2) a bf16 model: gradients (and the hook's output) are bf16
    for name in ("topk", "sign"):
        ddp = DDP(_model(torch.bfloat16), **DDP_KW)
        state = CompressionState(ddp, Plan.uniform(name), min_compress_numel=64)
        ddp.register_comm_hook(state, compression_hook)
        _backward(ddp, rank, dtype=torch.bfloat16)
        state.close()
        results[f"bf16/{name}"] = (None, _grads(ddp))
    return results


def test_bf16_autocast_and_bf16_models():
    per_rank = run_distributed(_bf16, 2)
    for key, (out_dtype, grads) in per_rank[0].items():
        if key.startswith("autocast/"):
            assert out_dtype == torch.bfloat16
            assert all(g.dtype == torch.float32 for g in grads)
        else:
            assert all(g.dtype == torch.bfloat16 for g in grads)
        assert all(torch.isfinite(g).all() for g in grads), key
        assert any(g.abs().sum() > 0 for g in grads), key
        for g0, g1 in zip(grads, per_rank[1][key][1], strict=True):
            assert torch.equal(g0, g1), key  # ranks agree exactly


def _plan_swap(rank: int, world_size: int):
    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(ddp, Plan(), min_compress_numel=64)
    ddp.register_comm_hook(state, compression_hook)
    wire_after_step = []
    for step in range(4):
        if step == 2:
            state.set_plan(Plan.uniform("topk", ratio=0.01, version=1))
        ddp.zero_grad()
        _backward(ddp, rank, step)
        wire_after_step.append(state.ledger.wire_total)
    state.close()
    return wire_after_step, state.plan.version


def test_plan_swapped_between_steps_applies_from_the_next_step():
    wire, version = run_distributed(_plan_swap, 2)[0]
    per_step = [wire[0]] + [b - a for a, b in zip(wire, wire[1:], strict=False)]
    assert version == 1
    assert per_step[0] == per_step[1]  # dense
    assert per_step[2] == per_step[3] < per_step[1] / 5  # compressed from step 2 on


def test_plan_set_during_a_step_waits_for_the_next_step():
    reducer = CompressedReducer(Plan(), min_compress_numel=0)
    grads = [torch.randn(100, 10)]
    reducer.begin_step()
    reducer.set_plan(Plan.uniform("topk", ratio=0.1, version=7))
    assert reducer.plan.version == 0
    reducer.reduce(["w"], grads)
    assert reducer.compressor_for("w").name == "none"
    reducer.end_step()
    assert reducer.plan.version == 7


def _resume(rank: int, world_size: int, plan: dict):
    """Train 4 steps; separately train 2, save, restore into fresh objects, train 2."""
    plan = Plan.from_dict(plan)

    def fresh():
        ddp = DDP(_model(), **DDP_KW)
        state = CompressionState(ddp, plan, min_compress_numel=64)
        ddp.register_comm_hook(state, compression_hook)
        return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def steps(ddp, opt, start, stop):
        for step in range(start, stop):
            opt.zero_grad()
            _backward(ddp, rank, step)
            opt.step()

    ddp, state, opt = fresh()
    steps(ddp, opt, 0, 4)
    straight = [p.detach().clone() for p in ddp.parameters()]
    state.close()

    ddp, state, opt = fresh()
    steps(ddp, opt, 0, 2)
    saved = (ddp.state_dict(), opt.state_dict(), state.state_dict())
    state.close()
    ddp, state, opt = fresh()
    ddp.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    steps(ddp, opt, 2, 4)
    state.close()
    return straight, [p.detach() for p in ddp.parameters()], state.step


@pytest.mark.parametrize(
    "plan",
    [Plan.uniform("powersgd", rank=2), Plan.uniform("dgc_topk", ratio=0.05), Plan.uniform("sign")],
    ids=["powersgd", "dgc_topk", "sign"],
)
def test_state_dict_resume_is_bit_exact(plan):
    for straight, resumed, step in run_distributed(_resume, 2, plan.to_dict()):
        assert step == 4
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)


def test_bad_input_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match=r"compressor: unknown name 'nope'; allowed: .*topk"):
        Plan.uniform("nope")
    with pytest.raises(ValueError, match=r"ratio: must be in \(0, 1\], got 2"):
        Plan.uniform("topk", ratio=2)
    with pytest.raises(ValueError, match=r"rank: must be >= 1, got 0"):
        Plan.uniform("powersgd", rank=0)
    with pytest.raises(ValueError, match=r"memory: unknown kind 'ef'; allowed: residual, dgc, none"):
        CompressedReducer(memory="ef")
    with pytest.raises(ValueError, match=r"min_compress_numel: expected an integer >= 0"):
        CompressedReducer(min_compress_numel=-1)
    with pytest.raises(ValueError, match=r"gradient 'w': dtype torch.int64 is not floating point"):
        CompressedReducer().reduce(["w"], [torch.arange(10)])
    with pytest.raises(ValueError, match=r"plan: unknown key 'layer'"):
        Plan.from_dict({"layer": {}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_step_flag_sees_every_non_finite_element_wherever_it_sits(dtype):
    from raycomp._internal.reduce.signals import all_finite

    grads = [torch.randn(5, 7).to(dtype), torch.empty(0, dtype=dtype), torch.randn(4097).to(dtype)]
    assert bool(all_finite(grads))
    assert all_finite([]) is None and all_finite([torch.empty(0)]) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        for which, index in ((0, 0), (0, 34), (2, 0), (2, 2048), (2, 4096)):  # first, last, middle
            poisoned = [g.clone() for g in grads]
            poisoned[which].view(-1)[index] = bad
            assert not bool(all_finite(poisoned)), (bad, which, index)
    huge = torch.full((3,), torch.finfo(dtype).max, dtype=dtype)  # finite, however large
    assert bool(all_finite([huge, -huge]))


def test_the_step_flag_covers_compressed_layers_and_the_mean_carries_dense_ones():
    # the weight (2048 elements) goes int8 or bf16, the bias (64) dense; one NaN in either.
    # A compressed layer's NaN is flagged; a dense one's is in the mean. A cast's is not
    # flagged (no scan): it is carried into the mean, where the guard finds it
    for name, poisoned, flagged in (("int8", "w", True), ("int8", "b", False), ("bf16", "w", False)):
        gen = torch.Generator().manual_seed(0)
        grads = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(64, generator=gen)}
        grads[poisoned].view(-1)[5] = float("nan")
        reducer = CompressedReducer(Plan.uniform(name), min_compress_numel=1024)
        means = dict(zip(grads, reducer.reduce(list(grads), list(grads.values()), closes_step=True), strict=True))
        reducer.end_step()
        assert reducer.local_nonfinite is flagged, (name, poisoned)
        if name == "int8":
            assert bool(torch.isfinite(means["b"]).all()) is flagged  # a dense NaN is in the mean
        else:
            assert not bool(torch.isfinite(means["w"]).all())


def test_buffer_view_finds_tensors_that_lie_back_to_back_and_nothing_else():
    from raycomp._internal.transports import buffer_view

    buffer = torch.arange(20, dtype=torch.float32)
    a, b, c = buffer[2:8].view(2, 3), buffer[8:12], buffer[12:20].view(4, 2)
    view = buffer_view([a, b, c])
    assert view is not None and view.data_ptr() == a.data_ptr() and torch.equal(view, buffer[2:20])
    assert buffer_view([a, c]) is None  # a gap
    assert buffer_view([b, a]) is None  # out of order
    assert buffer_view([a, b.clone()]) is None  # another storage
    assert buffer_view([buffer[:6].view(3, 2).t()]) is None  # not contiguous
    assert buffer_view([buffer[:4], buffer.view(torch.int32)[4:8]]) is None  # another dtype
    assert buffer_view([]) is None



def _dense_reduction(rank: int, world_size: int, stats_every: int):
    """Per all_reduce of the dense hook's last step: does it reduce inside a bucket buffer
    (no copy)? And each layer's gradient norm in the statistics against the local one."""
    import torch.distributed as dist

    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(ddp, Plan(), min_compress_numel=0, stats_every=stats_every, async_comm=False)
    buckets, calls, original = [], [], dist.all_reduce

    def hook(s, bucket):
        start = bucket.buffer().data_ptr()
        buckets.append(range(start, start + bucket.buffer().numel() * bucket.buffer().element_size()))
        return compression_hook(s, bucket)

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.data_ptr())
        return original(tensor, *args, **kwargs)

    ddp.register_comm_hook(state, hook)
    for step in range(3):  # buckets are rebuilt after the first iteration: look at the last
        buckets.clear(), calls.clear()
        ddp.zero_grad()
        dist.all_reduce = spy
        try:
            _backward(ddp, rank, step)
        finally:
            dist.all_reduce = original
    local = _model()
    _backward(local, rank, 2)
    names = dict(local.named_parameters())
    norms = [(s.grad_norm, float(names[s.layer].grad.norm())) for s in state.stats]
    state.close()
    return [any(ptr in b for b in buckets) for ptr in calls], norms


def test_a_dense_bucket_is_reduced_where_it_lies_unless_statistics_need_the_local_gradients():
    for inside, norms in run_distributed(_dense_reduction, 2, 0):
        assert len(inside) >= 2 and all(inside)  # every bucket's all_reduce, on its own buffer
        assert norms == []
    for inside, norms in run_distributed(_dense_reduction, 2, 1):  # statistics every step
        assert len(inside) >= 2 and not any(inside)  # a copy: the local gradients stay
        assert len(norms) == 6 and all(g == pytest.approx(local, rel=1e-6) for g, local in norms)


def test_statistics_tell_the_gradient_from_the_gradient_plus_residual():
    # Top-10% keeps a residual, so from the second step on what is compressed is the
    # gradient plus that residual; the gradient norm is the gradient's own
    reducer = CompressedReducer(Plan.uniform("topk", ratio=0.1), min_compress_numel=0, stats_every=1)
    gen = torch.Generator().manual_seed(0)
    residuals = []
    for _ in range(2):
        grad = torch.randn(32, 16, generator=gen)
        reducer.reduce(["w"], [grad.clone()], closes_step=True)
        reducer.end_step()
        residuals.append(reducer.memory.residuals["w"].clone())
    (stats,) = reducer.stats
    assert stats.grad_norm == pytest.approx(float(grad.norm()), rel=1e-6)
    assert stats.residual_norm > 0.5 * stats.grad_norm  # the residual is far from negligible
    # what was compressed is grad + the first residual; what was not sent is the second
    assert stats.residual_norm == pytest.approx(float(residuals[1].norm()), rel=1e-6)
    compensated = grad + residuals[0]
    assert stats.compression_error == pytest.approx(float(residuals[1].norm() / compensated.norm()), rel=1e-5)


def test_a_cast_decodes_what_it_sent_only_where_statistics_read_it():
    # the summable transport hands back the input as a cast's contribution (nothing is kept
    # for it), except on statistics steps, which measure its rounding error
    from raycomp._internal.transports import summable_allreduce
    from raycomp._internal.transports.work import Group

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(32, 16, generator=gen), torch.randn(40, generator=gen)]
    casts = [CompressorSpec.of("bf16").build(f"l{i}", 0) for i in range(2)]
    kept = summable_allreduce(grads, casts, Group()).wait()
    lean = summable_allreduce(grads, casts, Group(), keep_sent=False).wait()
    for g, k, r in zip(grads, kept, lean, strict=True):
        assert torch.equal(k.mean, r.mean) and torch.equal(k.mean, g.to(torch.bfloat16).float())
        assert r.sent is g and torch.equal(k.sent, k.mean) and not torch.equal(k.sent, g)
        assert k.wire_bytes == r.wire_bytes
    for stats_every, error in ((1, True), (0, False)):
        reducer = CompressedReducer(Plan.uniform("bf16"), min_compress_numel=0, stats_every=stats_every)
        reducer.reduce(["w"], [grads[0].clone()], closes_step=True)
        reducer.end_step()
        assert "w" not in getattr(reducer.memory, "residuals", {})  # a cast keeps nothing
        assert bool(reducer.stats) is error
        if error:
            (stats,) = reducer.stats
            assert stats.compressor == "bf16" and 0 < stats.compression_error < 1e-2


def test_a_cast_that_encodes_its_own_way_keeps_its_encoding():
    # the one-buffer cast path serves plain casts only: a subclass's own _compress and
    # decompress still run (here: scaled by 1024 on the wire, as a user's fp16 might be)
    from raycomp._internal.transports import summable_allreduce
    from raycomp._internal.transports.work import Group
    from raycomp.compressors.casts import Cast

    class Scaled(Cast):
        name, wire_dtype, calls = "scaled_fp16_test", torch.float16, 0

        def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
            type(self).calls += 1
            return Payload({"values": (flat * 1024).to(self.wire_dtype)}, shape, dtype)

        def decompress(self, payload: Payload) -> torch.Tensor:
            return super().decompress(payload) / 1024

    tiny = torch.full((64,), 1e-6)  # fp16 keeps 1e-6 * 1024, not 1e-6 itself (subnormal)
    (result,) = summable_allreduce([tiny], [Scaled()], Group()).wait()
    assert Scaled.calls == 1
    torch.testing.assert_close(result.mean, tiny, rtol=1e-3, atol=0)


class _KeepingMemory:
    """A user's memory whose compensate hands back a buffer it keeps (the protocol allows it)."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        self.kept[name] = grad.clone()
        return self.kept[name]

    def update(self, name, compensated, sent, sparse) -> None:
        pass

    def residual(self, name):
        return None

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        pass


def _overwrite_only_the_callers_gradients(rank: int, world_size: int):
    memory = _KeepingMemory()
    reducer = CompressedReducer(Plan(), memory=memory, min_compress_numel=0)
    grad = torch.full((6,), float(rank + 1))
    mean = reducer.reduce(["w"], [grad], closes_step=True, overwrite=True)[0]
    reducer.end_step()
    return mean.tolist(), memory.kept["w"].tolist()


def test_an_in_place_reduction_never_writes_into_a_memorys_buffer():
    for mean, kept in run_distributed(_overwrite_only_the_callers_gradients, 2):
        assert mean == [1.5] * 6
        assert kept in ([1.0] * 6, [2.0] * 6)  # still this rank's compensated gradient


# --- what the hook reports as communication time (the adaptive policy's "comm") ------------
class Sleepy(Compressor):
    """fp32 through one all-reduce, 0.25 s to encode: a slow reduction, for timing only."""

    name = "sleepy"
    transport = Transport.ALLREDUCE

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        time.sleep(0.25)
        return Payload({"values": flat.float()}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors["values"].to(payload.dtype).reshape(payload.shape)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 0.8 s: compute that a reduction can hide behind."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205 - autograd's signature
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        time.sleep(0.8)
        return grad


class _Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


def _waited_for_reductions(rank: int, world_size: int, overlap: bool) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _Slow(), nn.Linear(64, 64))
    ddp = DDP(model, bucket_cap_mb=0.01)  # each weight in its own bucket
    # the output layer's weight, whose bucket backward hands over first, reduces slowly
    plan = Plan.per_layer({"2.weight": CompressorSpec.of("tests.test_hook:Sleepy")})  # no registration
    state = CompressionState(ddp, plan, min_compress_numel=0, async_comm=overlap)
    ddp.register_comm_hook(state, compression_hook)
    for step in range(2):  # DDP holds every gradient in one bucket at the first step
        before = state.comm_seconds
        ddp.zero_grad()
        ddp(torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * rank + step))).square().mean().backward()
    state.close()
    return state.comm_seconds - before, [p.grad.clone() for p in model.parameters()]


def test_comm_time_counts_what_the_step_waited_for_not_what_hid_behind_backward():
    # with the background thread the output layer's slow reduction (0.25 s) runs during the
    # 0.8 s of backward after it: only the input layer's quick one is left to wait for
    overlapped = run_distributed(_waited_for_reductions, 2, True)
    inline = run_distributed(_waited_for_reductions, 2, False)
    for (hidden, means), (waited, inline_means) in zip(overlapped, inline, strict=True):
        assert 0 < hidden < 0.15, hidden
        assert waited >= 0.25, waited  # inline, backward itself waits for every reduction
        for a, b in zip(means, inline_means, strict=True):
            assert torch.equal(a, b)


def _plain_step_ends_after_every_bucket(rank: int, world_size: int) -> tuple[list[list[bool]], float, bool]:
    # the output layer (16.8M weights) is the first bucket backward hands over, the two
    # others (36,936 weights) the last: gloo reduces them on two threads, and the small last
    # one is in well before the first
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4096), nn.Linear(4096, 4096))
    ddp = DDP(model, bucket_cap_mb=1)
    state = CompressionState(ddp, Plan(), min_compress_numel=0)
    returned: list[torch.futures.Future] = []
    seen: list[list[bool]] = []  # per step, when it ended: whether each earlier bucket was in
    end_step = state.reducer.end_step

    def ending() -> None:
        seen.append([f.done() for f in returned[:-1]])
        end_step()

    state.reducer.end_step = ending

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks real annotations, these would be strings
        returned.append(compression_hook(state, bucket))
        return returned[-1]

    ddp.register_comm_hook(state, hook)
    plain = True
    for step in range(3):  # DDP holds every gradient in one bucket at the first step
        returned.clear()
        ddp.zero_grad()
        ddp(torch.randn(2, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
        plain = plain and state.plain_in_hook()
    state.close()
    return seen[1:], state.comm_seconds, plain


def test_a_plain_step_ends_once_every_bucket_is_in():
    # the step's end (its statistics, its plan, its counted wait) waits for every bucket,
    # not only the last one handed over, which gloo can finish first
    for seen, comm, plain in run_distributed(_plain_step_ends_after_every_bucket, 2):
        assert plain  # the dense plan's plain step, not the threads
        assert [len(s) for s in seen] == [1, 1] and all(all(s) for s in seen), seen
        assert comm > 0


def _plain_ledger_of_a_state_on_the_inner_module(rank: int, world_size: int) -> list[dict[str, float]]:
    ledgers = []
    for on_inner in (False, True):
        ddp = DDP(_model(), **DDP_KW)
        state = CompressionState(ddp.module if on_inner else ddp, Plan(), min_compress_numel=0)
        ddp.register_comm_hook(state, compression_hook)
        for step in range(2):
            ddp.zero_grad()
            _backward(ddp, rank, step)
        assert state._plain
        ledgers.append(dict(state.ledger.wire_bytes))
        state.close()
    return ledgers


def test_a_plain_step_counts_every_layer_whether_the_state_holds_the_ddp_or_the_module_inside():
    # CompressionState takes the DDP or the module it wraps; a plain step counts the bytes of
    # every layer once, either way
    for on_ddp, on_inner in run_distributed(_plain_ledger_of_a_state_on_the_inner_module, 2):
        assert on_ddp == on_inner and len(on_ddp) == 6 and all(v > 0 for v in on_ddp.values()), (on_ddp, on_inner)


def _state_of_another_model(rank: int, world_size: int) -> str:
    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(_model(), Plan(), min_compress_numel=0)  # not the model DDP wraps
    ddp.register_comm_hook(state, compression_hook)
    try:
        _backward(ddp, rank)
    except Exception as error:  # noqa: BLE001 - DDP re-raises the hook's error as its own
        return str(error)
    finally:
        state.close()
        # the error comes before any collective of the hook's group: without this barrier
        # a rank could tear its groups down while the other still connects to that group
        dist.barrier()
    return "no error"


def test_a_state_of_another_model_than_ddps_fails_at_the_first_step():
    for message in run_distributed(_state_of_another_model, 2):
        assert "not in the model given to CompressionState" in message, message


# --- the next bucket is encoded while this one is on the wire ------------------------------
class Logged(MinMaxInt8):
    """int8 (one all-gather at two ranks) that logs each encode and decode; rank 1 takes
    0.3 s to encode, so rank 0's all-gather of a bucket stays in flight that long."""

    name = "logged"
    events: ClassVar[list[tuple[str, tuple[int, ...], float]]] = []
    threads: ClassVar[set[tuple[str, str]]] = set()  # (encode or decode, the thread it ran on)

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        if dist.get_rank() == 1:
            time.sleep(0.3)
        Logged.events.append(("encode", tuple(shape), time.perf_counter()))
        Logged.threads.add(("encode", threading.current_thread().name))
        return super()._compress(flat, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        Logged.events.append(("decode", tuple(payload.shape), time.perf_counter()))
        Logged.threads.add(("decode", threading.current_thread().name))
        return super().decompress(payload)


def _logged_step(rank: int, world_size: int, overlap: bool) -> tuple[list[tuple[str, tuple[int, ...]]], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48))
    ddp = DDP(model, bucket_cap_mb=0.01)  # each weight in its own bucket (16 and 12 KB)
    logged = CompressorSpec.of("tests.test_hook:Logged")  # by import path: no registration
    state = CompressionState(ddp, Plan.per_layer({"0.weight": logged, "1.weight": logged}),
                             min_compress_numel=0, async_comm=overlap)
    ddp.register_comm_hook(state, compression_hook)
    for step in range(2):  # DDP holds every gradient in one bucket at the first step
        Logged.events.clear()
        Logged.threads.clear()
        ddp.zero_grad()
        ddp(torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * rank + step))).square().mean().backward()
    state.close()
    order = [(kind, shape) for kind, shape, _ in sorted(Logged.events, key=lambda e: e[2])]
    backward = threading.current_thread().name
    threads = {(kind, "backward's" if name == backward else name) for kind, name in Logged.threads}
    return order, [p.grad.clone() for p in model.parameters()], threads


def test_next_bucket_is_encoded_while_this_one_is_on_the_wire():
    # backward hands over the output layer's weight (48 x 64) first, then the input layer's
    # (64 x 64) a moment later; rank 0's all-gather of the first waits 0.3 s for rank 1
    # (the two threads' way: tests/test_overlap.py)
    results = run_distributed(_logged_step, 2, True)
    order, means, threads = results[0]
    output_layer, input_layer = (48, 64), (64, 64)
    assert order.index(("encode", input_layer)) < order.index(("decode", output_layer)), order
    # at two ranks int8 is one all-gather a bucket: backward encodes and issues it, and the
    # decoding follows its completion on the thread that completes it (gloo's)
    assert {name for kind, name in threads if kind == "encode"} == {"backward's"}, threads
    assert "backward's" not in {name for kind, name in threads if kind == "decode"}, threads
    # one thread doing both: the first bucket is decoded before the second is encoded
    inline_order, inline_means, _ = run_distributed(_logged_step, 2, False)[0]
    assert inline_order.index(("decode", output_layer)) < inline_order.index(("encode", input_layer))
    for other in [inline_means] + [r[1] for r in results[1:]]:
        for a, b in zip(means, other, strict=True):
            assert torch.equal(a, b)


# --- a dense step issues its all-reduces from DDP's thread, as torch's hook does ----------------
def _issuing_threads(rank: int, world_size: int) -> tuple[list[set[str]], list[torch.Tensor]]:
    import threading

    ddp = DDP(_model(), **DDP_KW)
    state = CompressionState(ddp, Plan(), min_compress_numel=64)  # under int8 two biases stay dense
    ddp.register_comm_hook(state, compression_hook)
    issued: set[str] = set()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def logged(fn):
        def wrapper(*args, **kwargs):
            issued.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return wrapper

    # dense, dense, int8, int8, PowerSGD, PowerSGD, dense
    plans = {2: Plan.uniform("int8"), 4: Plan.uniform("powersgd", rank=2), 6: Plan()}
    per_step = []
    try:
        for name, fn in originals.items():
            setattr(dist, name, logged(fn))
        for step in range(7):
            if step in plans:
                state.set_plan(plans[step])
            issued.clear()
            ddp.zero_grad()
            _backward(ddp, rank, step)
            per_step.append({"backward's" if n == threading.current_thread().name else n for n in issued})
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        state.close()
    return per_step, _grads(ddp)


def test_a_step_whose_buckets_go_out_at_once_issues_from_ddps_thread_and_powersgd_from_the_sender():
    (threads, grads), (threads_1, grads_1) = run_distributed(_issuing_threads, 2)
    assert threads == threads_1
    backward, sender = {"backward's"}, {"raycomp-send_0"}
    # int8 at two ranks is one all-gather a bucket: backward issues it and the decoding is
    # chained on it; PowerSGD's Q waits for P, so its buckets go through the sending thread,
    # its dense layers (two biases) too: one thread issues every collective of a step, in
    # bucket order, on every rank
    assert threads == [backward, backward, backward, backward, sender, sender, backward], threads
    for a, b in zip(grads, grads_1, strict=True):
        assert torch.equal(a, b)
