"""raycomp.train's DDP sync on real gloo processes: a dense step of a small model reduced
after backward, with DDP's own reduction switched off for it (:class:`DdpStrategy`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp.train.ddp_strategy import DdpStrategy, reduces_after_backward
from raycomp.transports import OVERHEAD
from tests.distributed import run_distributed

CONTROL = 2  # control values each rank stages per step


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=gen) * (1 + rank), torch.randint(0, 4, (8,), generator=gen)


def _counted_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks real annotations, these would be strings
    state.hook_calls += 1
    return compression_hook(state, bucket)


def _synced(after_backward: bool, plan: Plan | None = None) -> tuple[DDP, CompressionState, DdpStrategy]:
    ddp = DDP(_model())
    state = CompressionState(ddp, plan or Plan(), min_compress_numel=0)
    state.hook_calls = 0
    ddp.register_comm_hook(state, _counted_hook)
    return ddp, state, DdpStrategy(ddp, state, after_backward=after_backward)


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


def _steps_against_plain_ddp(rank: int, world_size: int, plans: list[dict | None]) -> dict:
    plain = DDP(_model())
    ddp, state, sync = _synced(True)
    out: dict = {"equal": [], "deferred": [], "hook_calls": [], "sizes": [], "rows": [], "flag_after": [], "grads": []}
    for step, plan in enumerate(plans):
        if plan is not None:
            state.set_plan(Plan.from_dict(plan))
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(plain(x), y).backward()
        state.stage_control([float(rank + 1), float(step)])
        calls = state.hook_calls
        with _Collectives() as issued:
            loss = nn.functional.cross_entropy(ddp(x), y)
            out["deferred"].append(sync.deferred)
            loss.backward()
            sync.end_backward()
        out["flag_after"].append(ddp.require_backward_grad_sync)
        out["hook_calls"].append(state.hook_calls - calls)
        out["sizes"].append(issued.sizes)
        out["rows"].append(None if state.control_rows is None else state.control_rows.tolist())
        out["grads"].append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]))
        out["equal"].append(all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ddp.parameters(),
                                                                             strict=True)))
        with torch.no_grad():
            for p in (*plain.parameters(), *ddp.parameters()):
                p -= 0.1 * p.grad
        plain.zero_grad()
        ddp.zero_grad()
    # the buffers each forward broadcast from rank 0, as plain DDP's forwards did
    out["buffers"] = all(torch.equal(a, b) for a, b in zip(plain.buffers(), ddp.buffers(), strict=True))
    out["ledger"] = dict(state.ledger.wire_bytes)
    out["params"] = sum(p.numel() for p in ddp.parameters())
    state.close()
    return out


def test_a_dense_step_of_a_small_model_is_reduced_after_backward_as_ddp_reduces_it():
    results = run_distributed(_steps_against_plain_ddp, 2, [None] * 3)
    for rank, out in enumerate(results):
        assert out["deferred"] == [True] * 3  # DDP's reduction switched off before each backward
        assert out["hook_calls"] == [0] * 3  # so its comm hook never ran
        assert out["flag_after"] == [True] * 3  # and switched back on after the reduction
        assert out["equal"] == [True] * 3, "the mean differs from DDP's own all-reduce"
        assert out["buffers"], "BatchNorm's buffers were not broadcast as DDP broadcasts them"
        # one all-reduce a step: every gradient, one element for missing gradients, and the
        # control rows of both ranks (a flag and two values each): nothing else on the wire
        assert out["sizes"] == [[out["params"] + 1 + 2 * (1 + CONTROL)]] * 3, out["sizes"]
        for step, rows in enumerate(out["rows"]):
            assert rows == [[0.0, 1.0, float(step)], [0.0, 2.0, float(step)]], (rank, rows)
        # every layer counted at every step, dense (two ranks: a ring all-reduce sends its bytes once)
        model = _model()
        for name, p in model.named_parameters():
            assert out["ledger"][name] == 3 * p.numel() * 4, (name, out["ledger"])
        # and the rest of what went on the wire: the control rows and the missing count
        assert out["ledger"][OVERHEAD] == 3 * (2 * (1 + CONTROL) + 1) * 4, out["ledger"]


def test_a_compressed_step_goes_back_to_ddps_hook_and_a_dense_one_after_it_comes_back():
    int8 = Plan.uniform("int8").to_dict()
    results = run_distributed(_steps_against_plain_ddp, 2, [None, int8, None, Plan().to_dict(), None])
    for out in results:
        # int8 is lossy and leaves a residual in error feedback: the first dense step after
        # it goes through the hook, which sends the residual; the next one after backward
        assert out["deferred"] == [True, False, False, False, True], out["deferred"]
        assert [calls > 0 for calls in out["hook_calls"]] == [False, True, True, True, False]
        assert out["equal"][0] and not out["equal"][1]  # DDP's mean, then int8's
        assert out["flag_after"] == [True] * 5
    # every rank holds the same mean and the same control rows, whichever way each step went
    assert results[0]["rows"] == results[1]["rows"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["grads"], results[1]["grads"], strict=True))


def _accumulated(rank: int, world_size: int) -> tuple[bool, bool, list[int], int]:
    plain = DDP(_model())
    ddp, state, sync = _synced(True)
    for model in (plain, ddp):
        with _Collectives() as issued:
            with model.no_sync():  # the user's own accumulation: two micro-batches, then one synced
                for micro in range(2):
                    x, y = _batch(rank, micro)
                    nn.functional.cross_entropy(model(x), y).backward()
                inside = model.require_backward_grad_sync
            x, y = _batch(rank, 2)
            nn.functional.cross_entropy(model(x), y).backward()
            if model is ddp:
                sync.end_backward()
    equal = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ddp.parameters(), strict=True))
    state.close()
    return equal, inside, issued.sizes, state.hook_calls


def test_the_users_no_sync_is_left_alone_and_the_accumulated_gradients_reduced_once():
    for equal, inside, sizes, hook_calls in run_distributed(_accumulated, 2):
        assert not inside  # no_sync's own setting held inside it
        # one all-reduce for the three micro-batches, after the last one's backward: every
        # gradient and the count of missing ones (no control values staged)
        params = sum(p.numel() for p in _model().parameters())
        assert sizes == [params + 1] and hook_calls == 0, (sizes, hook_calls)
        assert equal


def _one_rank_leaves_a_layer_unused(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 4), "b": nn.Linear(8, 4)})
    ddp = DDP(model)
    state = CompressionState(ddp, Plan(), min_compress_numel=0)
    ddp.register_comm_hook(state, compression_hook)
    strategy = DdpStrategy(ddp, state, after_backward=True)

    x = torch.randn(2, 8)
    ddp.module.forward = lambda x: ddp.module["a"](x) + (ddp.module["b"](x) if rank == 0 else 0)
    ddp(x).sum().backward()
    try:
        strategy.end_backward()
    except RuntimeError as error:
        return str(error)
    finally:
        state.close()
    return "no error"


def test_a_parameter_without_a_gradient_on_one_rank_fails_on_every_rank_instead_of_hanging():
    messages = run_distributed(_one_rank_leaves_a_layer_unused, 2, timeout=60)
    assert "b.weight, b.bias on this rank" in messages[1], messages
    assert "a parameter on another rank" in messages[0], messages
    assert all("find_unused_parameters=True" in m for m in messages), messages


def _eligibility(rank: int, world_size: int) -> dict[str, bool]:
    cpu = torch.device("cpu")
    small = nn.Linear(64, 64)  # 16.6 KB of gradients
    big = nn.Linear(1024, 1024)  # 4.2 MB
    return {
        "small": reduces_after_backward(DDP(small), cpu),
        "two buckets": reduces_after_backward(DDP(big, bucket_cap_mb=2.1), cpu),
        "three buckets": reduces_after_backward(DDP(big, bucket_cap_mb=1.9), cpu),
        "find_unused": reduces_after_backward(DDP(small, find_unused_parameters=True), cpu),
        "static_graph": reduces_after_backward(DDP(small, static_graph=True), cpu),
        "cuda": reduces_after_backward(DDP(small), torch.device("cuda")),
        "not a DDP": reduces_after_backward(small, cpu),
    }


def test_only_a_small_cpu_ddp_without_unused_parameters_is_reduced_after_backward():
    eligible = run_distributed(_eligibility, 2)[0]
    assert eligible == {"small": True, "two buckets": True, "three buckets": False, "find_unused": False,
                        "static_graph": False, "cuda": False, "not a DDP": False}


def test_a_forward_without_gradients_leaves_ddps_sync_alone():
    # evaluation under no_grad: DDP prepares nothing, and neither does the sync
    results = run_distributed(_eval_forward, 2)
    assert results == [(False, True)] * 2


def _eval_forward(rank: int, world_size: int) -> tuple[bool, bool]:
    ddp, state, sync = _synced(True)
    with torch.no_grad():
        ddp(_batch(rank, 0)[0])
    deferred, flag = sync.deferred, ddp.require_backward_grad_sync
    state.close()
    return deferred, flag


def test_without_after_backward_the_hook_reduces_every_dense_step():
    # a framework's DDP (Lightning, the Hugging Face Trainer) keeps the hook on every step
    for calls in run_distributed(_hook_only, 2):
        assert calls == [1, 1]


def _hook_only(rank: int, world_size: int) -> list[int]:
    ddp, state, sync = _synced(False)
    calls = []
    for step in range(2):
        before = state.hook_calls
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        sync.end_backward()
        calls.append(state.hook_calls - before)
        ddp.zero_grad()
    state.close()
    return calls
