"""raycomp.train's DDP sync on real gloo processes (:class:`DdpStrategy`,
:mod:`raycomp._internal.ddp.step_route`): a dense step is DDP's own reduction (a statistics step reads each
rank's own gradient norms on the way), and raycomp's hook joins at the first compressed
step, the same step on every rank."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp._internal.train.ddp_strategy import DdpStrategy
from raycomp._internal.transports import OVERHEAD
from tests.distributed import run_distributed

CONTROL = 2  # control values each rank stages per step
LATE_S = 0.3  # how late one rank starts a backward


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=gen) * (1 + rank), torch.randint(0, 4, (8,), generator=gen)


def _counted_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks real annotations, these would be strings
    state.hook_calls += 1
    return compression_hook(state, bucket)


def _synced(stats_every: int = 0, **ddp_options: bool) -> tuple[DDP, CompressionState, DdpStrategy]:
    ddp = DDP(_model(), **ddp_options)
    state = CompressionState(ddp, Plan(), min_compress_numel=0, stats_every=stats_every)
    state.hook_calls = 0
    return ddp, state, DdpStrategy(ddp, state, hook=_counted_hook)


class _Collectives:
    """Every all-reduce issued, by element count, while in a ``with`` block."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._original = dist.all_reduce

    def __enter__(self) -> _Collectives:
        def counted(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.sizes.append(tensor.numel())
            return self._original(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _steps_against_plain_ddp(rank: int, world_size: int, plans: list[dict | None], stats_every: int = 0,
                             nan_at: int | None = None, late_at: int | None = None, skippable: bool = False) -> dict:
    plain = DDP(_model())
    ddp, state, strategy = _synced(stats_every)
    out: dict = {"equal": [], "ways": [], "hook_calls": [], "sizes": [], "rows": [], "flag_after": [], "grads": [],
                 "norms": [], "comm": [], "buffers_each": [], "own_norms": [], "stats": [], "skipped": []}
    for step, plan in enumerate(plans):
        if plan is not None:
            state.set_plan(Plan.from_dict(plan))
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(plain(x), y).backward()
        own = copy.deepcopy(ddp.module)  # this rank's own gradients, before any reduction
        nn.functional.cross_entropy(own(x), y).backward()
        out["own_norms"].append({name: float(p.grad.norm()) for name, p in own.named_parameters()})
        state.stage_control([float(rank + 1), float(step)], skippable=skippable)
        calls, comm = state.hook_calls, state.comm_seconds
        with _Collectives() as issued:
            loss = nn.functional.cross_entropy(ddp(x), y)
            out["ways"].append(strategy.sync.way.value)
            if step == nan_at and rank == 1:
                loss = loss * float("nan")
            if step == late_at and rank == 1:
                time.sleep(LATE_S)  # rank 0's backward then waits for this rank's gradients
            loss.backward()
            strategy.end_backward()
        out["comm"].append(state.comm_seconds - comm)
        out["norms"].append(state.gradient_norm(list(ddp.parameters())))
        out["flag_after"].append(ddp.require_backward_grad_sync)
        # each forward broadcast rank 0's buffers first, as plain DDP's forward did
        out["buffers_each"].append(all(torch.equal(a, b) for a, b in zip(plain.buffers(), ddp.buffers(),
                                                                            strict=True)))
        out["hook_calls"].append(state.hook_calls - calls)
        out["sizes"].append(issued.sizes)
        out["rows"].append(None if state.control_rows is None else state.control_rows.tolist())
        out["skipped"].append(state.control_skipped)
        fresh = state.stats_step == state.step - 1
        out["stats"].append({st.layer: st.grad_norm for st in state.stats} if fresh else None)
        out["grads"].append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]))
        out["equal"].append(all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ddp.parameters(),
                                                                             strict=True)))
        with torch.no_grad():
            for p in (*plain.parameters(), *ddp.parameters()):
                p -= 0.1 * torch.nan_to_num(p.grad)
        plain.zero_grad()
        ddp.zero_grad()
    # the buffers each forward broadcast from rank 0, as plain DDP's forwards did
    out["buffers"] = all(torch.equal(a, b) for a, b in zip(plain.buffers(), ddp.buffers(), strict=True))
    out["ledger"] = dict(state.ledger.wire_bytes)
    out["params"] = sum(p.numel() for p in ddp.parameters())
    out["steps"] = {way.value: n for way, n in strategy.sync.steps.items()}
    out["hooked"] = strategy.sync.hooked
    state.close()
    return out


def _layer_bytes(steps: int) -> dict[str, int]:
    return {name: steps * p.numel() * 4 for name, p in _model().named_parameters()}


def test_a_dense_step_is_ddps_own_reduction_with_the_control_values_beside_it():
    results = run_distributed(_steps_against_plain_ddp, 2, [None] * 3, 0, None, 2)
    for rank, out in enumerate(results):
        assert out["ways"] == ["ddp"] * 3 and not out["hooked"]
        assert out["hook_calls"] == [0] * 3  # raycomp's hook is not even registered
        assert out["flag_after"] == [True] * 3  # DDP's sync never switched off
        assert out["equal"] == [True] * 3, "the mean differs from DDP's own all-reduce"
        assert out["buffers"], "BatchNorm's buffers were not broadcast as DDP broadcasts them"
        # raycomp's only collective: the control rows of both ranks (a flag and two values
        # each); the gradients went through DDP's C++ all-reduce
        assert out["sizes"] == [[2 * (1 + CONTROL)]] * 3, out["sizes"]
        for step, rows in enumerate(out["rows"]):
            assert rows == [[0.0, 1.0, float(step)], [0.0, 2.0, float(step)]], (rank, rows)
        # every layer counted at every step, dense (two ranks: a ring all-reduce sends its bytes once)
        assert {k: v for k, v in out["ledger"].items() if k != OVERHEAD} == _layer_bytes(3), out["ledger"]
        assert out["ledger"][OVERHEAD] == 3 * 2 * (1 + CONTROL) * 4, out["ledger"]
    # what DDP's all-reduce made backward wait for is the step's communication: rank 0 waited
    # for the late rank after its last gradient was computed
    assert results[0]["comm"][2] > LATE_S / 2, results[0]["comm"]


def test_skippable_control_values_leave_ddps_own_step_without_a_collective_but_ride_the_hooks():
    # controller.dense_control: at_boundaries. DDP's own steps 0 and 1 go without them (and
    # a NaN on one rank at step 1 still reaches every rank's guard, through the mean's norm);
    # the compressed step 2 and the hook's dense step 3 carry them in collectives that run anyway
    int8 = Plan.uniform("int8").to_dict()
    results = run_distributed(_steps_against_plain_ddp, 2, [None, None, int8, Plan().to_dict()], 0, 1, None, True)
    for out in results:
        assert out["ways"] == ["ddp", "ddp", "hook", "hook"], out["ways"]
        assert out["sizes"][:2] == [[], []], out["sizes"]  # no collective of raycomp's at all
        assert out["rows"][:2] == [None, None] and out["skipped"] == [True, True, False, False]
        assert math.isfinite(out["norms"][0]) and not math.isfinite(out["norms"][1]), out["norms"]
        assert out["equal"][0], "the mean differs from DDP's own all-reduce"
        for step in (2, 3):
            assert out["rows"][step] == [[0.0, 1.0, float(step)], [0.0, 2.0, float(step)]], out["rows"]
        # the control values' bytes: steps 2 and 3 only, inside the hook's own collectives
        assert out["ledger"][OVERHEAD] == 2 * 2 * (1 + CONTROL) * 4, out["ledger"]
    first, second = results[0]["grads"], results[1]["grads"]  # every rank the same mean (NaN at step 1)
    assert all(torch.equal(first[step], second[step]) for step in (0, 2, 3))


def test_a_dense_statistics_step_reads_each_ranks_own_gradients_on_the_way_to_ddp():
    results = run_distributed(_steps_against_plain_ddp, 2, [None] * 4, 2)
    for out in results:
        assert out["ways"] == ["ddp"] * 4 and out["equal"] == [True] * 4, out["ways"]
        assert out["sizes"] == [[2 * (1 + CONTROL)]] * 4, out["sizes"]  # the rows alone, as on other steps
        # statistics at the step before each multiple of stats_every: steps 1 and 3, each
        # layer's norm this rank's own (the ranks' batches differ), not the mean's
        assert [stats is not None for stats in out["stats"]] == [False, True, False, True]
        for step in (1, 3):
            assert out["stats"][step] == pytest.approx(out["own_norms"][step], rel=1e-6), step
        assert out["buffers_each"] == [True] * 4
        assert out["steps"] == {"ddp": 4, "hook": 0}
    assert results[0]["stats"][1] != pytest.approx(results[1]["stats"][1], rel=1e-3)


def test_a_compressed_step_registers_the_hook_at_the_same_step_on_every_rank_and_keeps_it():
    int8 = Plan.uniform("int8").to_dict()
    results = run_distributed(_steps_against_plain_ddp, 2, [None, int8, None, Plan().to_dict(), None])
    for out in results:
        # DDP takes one comm hook for good: after the first compressed step every step is
        # the hook's, the dense ones after it its plain step
        assert out["ways"] == ["ddp", "hook", "hook", "hook", "hook"], out["ways"]
        assert [calls > 0 for calls in out["hook_calls"]] == [False, True, True, True, True]
        assert out["equal"][0] and not out["equal"][1]  # DDP's mean, then int8's
        assert out["flag_after"] == [True] * 5 and out["hooked"]
    # every rank holds the same mean and the same control rows, whichever way each step went
    assert results[0]["rows"] == results[1]["rows"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["grads"], results[1]["grads"], strict=True))


def test_a_nan_on_one_rank_in_ddps_own_step_reaches_every_ranks_guard_at_that_step():
    results = run_distributed(_steps_against_plain_ddp, 2, [None] * 3, 0, 1)
    for out in results:
        assert out["ways"] == ["ddp"] * 3
        # the flag in the rows cannot see it (sent before backward); the mean's norm, which
        # the guard reads on every rank, does
        assert math.isfinite(out["norms"][0]) and not math.isfinite(out["norms"][1]), out["norms"]
        assert math.isfinite(out["norms"][2])


def _accumulated(rank: int, world_size: int) -> tuple[bool, bool, list[int], int, bool]:
    plain = DDP(_model())
    ddp, state, sync = _synced(1)  # a statistics step: each rank's own norms are read
    for model in (plain, ddp):
        with _Collectives() as issued:
            with model.no_sync():  # the user's own accumulation: two micro-batches, then one synced
                for micro in range(2):
                    x, y = _batch(rank, micro)
                    nn.functional.cross_entropy(model(x), y).backward()
                # nothing decided inside, nothing switched: the synchronising forward decides
                inside = model.require_backward_grad_sync or (model is ddp and sync.sync.way is not None)
            x, y = _batch(rank, 2)
            nn.functional.cross_entropy(model(x), y).backward()
            if model is ddp:
                sync.end_backward()
    equal = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ddp.parameters(), strict=True))
    own = _model()  # this rank's own gradient of the three micro-batches, never reduced
    for micro in range(3):
        x, y = _batch(rank, micro)
        nn.functional.cross_entropy(own(x), y).backward()
    measured = {st.layer: st.grad_norm for st in state.stats}
    own_norms = measured == pytest.approx({name: float(p.grad.norm()) for name, p in own.named_parameters()},
                                          rel=1e-6)
    state.close()
    return equal, inside, issued.sizes, state.hook_calls, own_norms


def test_the_users_no_sync_is_left_alone_and_the_accumulated_gradients_reduced_once():
    for equal, inside, sizes, hook_calls, own_norms in run_distributed(_accumulated, 2):
        assert not inside  # no_sync's own setting held inside it
        # DDP's one all-reduce of the three micro-batches, in C++; nothing from Python (no
        # control values staged), the hook never registered
        assert sizes == [] and hook_calls == 0, (sizes, hook_calls)
        assert equal
        assert own_norms, "the statistics are not the rank's own gradient of the whole accumulated step"


def _hooked_at_once(rank: int, world_size: int) -> dict[str, bool]:
    out = {}
    for name, options in {"plain": {}, "find_unused": {"find_unused_parameters": True},
                          "static_graph": {"static_graph": True}}.items():
        ddp, state, strategy = _synced(**options)
        out[name] = strategy.sync.hooked
        state.close()
    return out


def test_ddp_with_its_own_bookkeeping_of_a_step_gets_the_hook_at_once():
    assert run_distributed(_hooked_at_once, 2)[0] == {"plain": False, "find_unused": True, "static_graph": True}


def test_a_forward_without_gradients_leaves_ddps_sync_alone():
    # evaluation under no_grad: DDP prepares nothing, and neither does the sync
    results = run_distributed(_eval_forward, 2)
    assert results == [(None, True)] * 2


def _eval_forward(rank: int, world_size: int) -> tuple[object, bool]:
    ddp, state, strategy = _synced(1)
    with torch.no_grad():
        ddp(_batch(rank, 0)[0])
    way, flag = strategy.sync.way, ddp.require_backward_grad_sync
    state.close()
    return way, flag


def test_a_strategy_without_raycomps_hook_leaves_ddp_to_the_hook_given():
    # a benchmark's torch hook: raycomp registers nothing and switches nothing off
    params = sum(p.numel() for p in _model().parameters())
    for calls, sizes in run_distributed(_torch_hook_only, 2):
        assert calls == [1, 1] and sizes == [[params], [params]]  # the torch hook's one bucket, nothing else


def _counting_allreduce_hook(calls, bucket):  # noqa: ANN001, ANN202 - DDP checks real annotations
    calls.append(1)
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _torch_hook_only(rank: int, world_size: int) -> tuple[list[int], list[list[int]]]:
    ddp = DDP(_model())
    state = CompressionState(ddp, Plan(), min_compress_numel=0)
    strategy = DdpStrategy(ddp, state, hook=None)
    torch_calls: list[int] = []
    ddp.register_comm_hook(torch_calls, _counting_allreduce_hook)
    counts, sizes = [], []
    for step in range(2):
        before = len(torch_calls)
        x, y = _batch(rank, step)
        with _Collectives() as issued:
            nn.functional.cross_entropy(ddp(x), y).backward()
            strategy.end_backward()
        counts.append(len(torch_calls) - before)
        sizes.append(issued.sizes)
        ddp.zero_grad()
    state.close()
    return counts, sizes
