"""An elastic resize: a checkpoint of W workers restored on W' (raycomp._internal.train.resize).

Every rank's state is accounted for: the error-feedback mass the old ranks owed the model
is owed by the new ones (the mean of the residuals, server residuals included), what must
agree across ranks is identical on every new rank, byte totals and summed counters keep
their sums, per-rank seeds stay per rank; a checkpoint of the same size still restores
rank for rank. Real gloo ranks train Top-K and int4 with error feedback at W = 4 and resume
at W = 2 and 3.
"""

from __future__ import annotations

import contextlib
import copy
import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from raycomp import CompressionState
from raycomp._internal.train import checkpoint, resize, resume
from raycomp._internal.train.preemption import PreemptionWatch
from raycomp._internal.train.reporter import Outages
from raycomp._internal.train.run_state import Progress, RankParts
from raycomp.compressors.base import mix_seed
from raycomp.plan import CompressorSpec, Plan
from tests.distributed import run_distributed

SIZES = [(4, 3), (4, 2), (2, 4), (3, 4)]
SHAPES = {"a": [4, 5], "b": [10], "c": [11], "w": [6, 3]}
SEED = 7


def _chunk_sizes(numel: int, parts: int) -> list[int]:
    base, extra = divmod(numel, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def _server_full(states: list[dict], name: str, numel: int) -> torch.Tensor:
    """The owed correction of the mean over the whole layer: rank r's chunk r (the test's
    own reading of the scalable route's layout)."""
    sizes = _chunk_sizes(numel, len(states))
    pieces = []
    for r, size in enumerate(sizes):
        piece = states[r].get("server_residuals", {}).get(name)
        pieces.append(torch.zeros(size, dtype=torch.float64) if piece is None else piece.double().reshape(-1))
    return torch.cat(pieces)


def _owed(reducers: list[dict], shapes: dict) -> dict[str, torch.Tensor]:
    """Per layer, what the ranks together still owe the mean: (1/W) sum of the residuals
    plus the server residuals, in float64."""
    w = len(reducers)
    owed = {}
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        total = torch.zeros(numel, dtype=torch.float64)
        for state in reducers:
            residual = state["memory"].get("residuals", {}).get(name)
            if residual is not None:
                total += residual.double().reshape(-1) / w
        if any("server_residuals" in s for s in reducers):
            total += _server_full(reducers, name, numel)
        owed[name] = total
    return owed


def _reducer_state(rank: int, world: int, gen: torch.Generator) -> dict:
    residuals = {"a": torch.randn(4, 5, generator=gen), "w": torch.randn(6, 3, generator=gen)}
    if rank != 1:  # rank 1 sent layer b in full: no residual there
        residuals["b"] = torch.randn(10, generator=gen)
    server_chunk = torch.randn(_chunk_sizes(11, world)[rank], generator=gen)
    qsgd, powersgd = CompressorSpec.of("qsgd"), CompressorSpec.of("powersgd", rank=1)
    return {
        "step": 12, "plan": Plan.uniform("topk", ratio=0.1).to_dict(), "pending_plan": None,
        "memory": {"residuals": residuals},
        "server_residuals": {"c": server_chunk},
        "compressors": {
            "a": {"spec": qsgd.to_dict(), "state": qsgd.build("a", rank, SEED).state_dict() | {
                "draws": {"seed": mix_seed(SEED, "a", rank), "draws": 24}}},
            "w": {"spec": powersgd.to_dict(), "state": {"q": torch.ones(3, 1) * 0.5,
                                                       "draws": {"seed": mix_seed(SEED, "w", "shared"), "draws": 1}}},
        },
        "ledger": {"wire_bytes": {"a": 100.0 * (rank + 1), "b": 7.0}, "dense_bytes": {"a": 800.0 * (rank + 1)}},
        "loss_scale": {"scale": None},
    }


def _olds(world: int, local: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(world)
    out = []
    for r in range(world):
        compression = _reducer_state(r, world, gen)
        if local:
            compression = {"hook": compression, "mode": {"sync_every": 4},
                           "local": {"inner_steps": 9, "outer_steps": 2, "origin": 0, "equal_at": [8],
                                     "global": [torch.full((4, 5), 0.25)], "outer": {"state": {}},
                                     "reducer": _reducer_state(r, world, gen)}}
        out.append({
            "compression": compression, "guard": {"active": False, "events": [1, 2]},
            "controller_plan": Plan.uniform("topk", ratio=0.1).with_version(3).to_dict(),
            "rng": torch.Generator().manual_seed(100 + r).get_state(),
            "counters": {"plan_switches": 3, "outages": r + 1, "skipped_steps": 1, "lr_ramp_from": 5,
                         "loss_scale_overflows": 0, "outer_steps": 2, "local_skips": 2 * r},
            "grad_scaler": None,
            "replica": {"model": {"x": torch.full((2,), float(r))}, "optimizer": {}} if local else None,
        })
    return out


def _assert_same(a, b) -> None:
    """Equal nested state, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (sorted(a), sorted(b))
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _reducers(compression: dict) -> list[dict]:
    return [compression["hook"], compression["local"]["reducer"]] if "hook" in compression else [compression]


@pytest.mark.parametrize(("old", "new"), SIZES, ids=[f"{a}to{b}" for a, b in SIZES])
@pytest.mark.parametrize("local", [False, True], ids=["per_step", "local_steps"])
def test_every_ranks_state_is_accounted_for_after_a_resize(old, new, local):
    olds = _olds(old, local)
    kept = copy.deepcopy(olds)
    news = [resize.merge_own(olds, j, new, SEED, SHAPES) for j in range(new)]
    _assert_same(olds, kept)  # the old states are read, never changed

    for which in range(len(_reducers(olds[0]["compression"]))):
        before = [_reducers(o["compression"])[which] for o in olds]
        after = [_reducers(n["compression"])[which] for n in news]
        # the owed mean is preserved (server residuals folded into the residuals)
        owed_before, owed_after = _owed(before, SHAPES), _owed(after, SHAPES)
        for name in SHAPES:
            torch.testing.assert_close(owed_after[name], owed_before[name], rtol=0, atol=1e-6)
        assert all(a["server_residuals"] == {} for a in after)
        # every new rank holds the same merged residual
        for a in after[1:]:
            _assert_same(a["memory"], after[0]["memory"])
        # agreed state from old rank 0, identical on every rank
        for a in after:
            for key in ("step", "plan", "pending_plan", "loss_scale"):
                _assert_same(a[key], before[0][key])
            _assert_same(a["compressors"]["w"], before[0]["compressors"]["w"])  # PowerSGD's Q, shared seed
        # a per-rank seed stays per rank (the router's), with rank 0's count of draws
        for j, a in enumerate(after):
            draws = a["compressors"]["a"]["state"]["draws"]
            assert draws == {"seed": mix_seed(SEED, "a", j), "draws": 24}
        # byte totals: the same sums, per layer
        for key in ("wire_bytes", "dense_bytes"):
            for layer in ("a", "b"):
                total_before = sum(b["ledger"][key].get(layer, 0.0) for b in before)
                assert sum(a["ledger"][key].get(layer, 0.0) for a in after) == total_before
    for j, n in enumerate(news):
        _assert_same(n["guard"], olds[0]["guard"])
        _assert_same(n["controller_plan"], olds[0]["controller_plan"])
        assert n["replica"] is None
        if j < old:
            _assert_same(n["rng"], olds[j]["rng"])
        else:
            assert n["rng"] is None  # a new rank keeps the generator its training function seeded
        for key in ("plan_switches", "skipped_steps", "lr_ramp_from", "outer_steps"):
            assert n["counters"][key] == olds[0]["counters"][key]
        if local:
            local_new, local_old = n["compression"]["local"], olds[0]["compression"]["local"]
            for key in ("global", "outer", "inner_steps", "outer_steps", "origin", "equal_at"):
                _assert_same(local_new[key], local_old[key])
            _assert_same(n["compression"]["mode"], olds[0]["compression"]["mode"])
    for key in ("outages", "local_skips"):
        assert sum(n["counters"][key] for n in news) == sum(o["counters"][key] for o in olds)


@pytest.mark.parametrize(("old", "new"), SIZES, ids=[f"{a}to{b}" for a, b in SIZES])
def test_dgc_memory_is_merged_as_a_mean(old, new):
    gen = torch.Generator().manual_seed(3)
    memories = [{"velocity": {"a": torch.randn(4, 5, generator=gen)},
                 "accumulated": {"a": torch.randn(4, 5, generator=gen)}} for _ in range(old)]
    olds = _olds(old)
    for o, memory in zip(olds, memories, strict=True):
        o["compression"]["memory"] = memory
    news = [resize.merge_own(olds, j, new, SEED, SHAPES) for j in range(new)]
    for key in ("velocity", "accumulated"):
        mean_before = sum(m[key]["a"].double() for m in memories) / old
        if key == "accumulated":  # the server residuals fold into the error-feedback slot
            assert "c" in news[0]["compression"]["memory"][key]
        mean_after = sum(n["compression"]["memory"][key]["a"].double() for n in news) / new
        torch.testing.assert_close(mean_after, mean_before, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("old", "new"), SIZES, ids=[f"{a}to{b}" for a, b in SIZES])
def test_without_memory_the_server_residuals_are_rechunked_for_the_new_size(old, new):
    olds = _olds(old)
    for o in olds:
        o["compression"]["memory"] = {}
    news = [resize.merge_own(olds, j, new, SEED, SHAPES) for j in range(new)]
    whole = torch.cat([n["compression"]["server_residuals"]["c"] for n in news])
    assert [n["compression"]["server_residuals"]["c"].numel() for n in news] == _chunk_sizes(11, new)
    torch.testing.assert_close(whole.double(), _server_full([o["compression"] for o in olds], "c", 11),
                               rtol=0, atol=0)


def test_a_bad_rank_or_a_sharded_state_is_refused_with_the_field_named():
    olds = _olds(2)
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 3\), got 3"):
        resize.merge_own(olds, 3, 3, SEED, SHAPES)
    olds[0]["compression"] = olds[1]["compression"] = {"step": 1, "comms": {}, "ledger": {}}
    with pytest.raises(ValueError, match=r"compression: a sharded \(fsdp\) state cannot be resized"):
        resize.merge_own(olds, 0, 3, SEED, SHAPES)


# --- resume.restore: the same size rank for rank, another size merged ----------------------
class _Recorder:
    def __init__(self) -> None:
        self.loaded = None

    def load_state_dict(self, state) -> None:
        self.loaded = state

    def state_dict(self) -> dict:  # a flat reducer's layout, as restore reads it before loading
        return {"memory": {}}


def _fake_parts(rank: int, world: int) -> RankParts:
    model = nn.Linear(3, 2)
    judge = _Recorder()
    judge.overflows = 0
    strategy = types.SimpleNamespace(layers=lambda: SHAPES, model=model, state=_Recorder(), sharded=False,
                                     per_step=True)
    return RankParts(rank, world, SEED, strategy, torch.optim.SGD(model.parameters(), lr=0.1), None, None, judge,
                     _Recorder(), Progress(), Outages(), types.SimpleNamespace(started_at=None), PreemptionWatch(None))


def _write_checkpoint(directory: Path, olds: list[dict]) -> None:
    for r, own in enumerate(olds):
        checkpoint.save_own(directory, r, own)
    model = nn.Linear(3, 2)
    checkpoint.save_shared(directory, model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                           {"global_step": 12, "epoch": 1, "world_size": len(olds)})


@pytest.mark.parametrize("world", [4, 3])
def test_restore_takes_its_own_file_at_the_same_size_and_merges_at_another(tmp_path, monkeypatch, world):
    import ray.train

    olds = _olds(4)
    _write_checkpoint(tmp_path, olds)
    found = types.SimpleNamespace(path=str(tmp_path), as_directory=lambda: contextlib.nullcontext(str(tmp_path)))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: found)
    rng = torch.get_rng_state()
    try:
        for rank in range(world):
            parts = _fake_parts(rank, world)
            resume.restore(parts)
            assert parts.progress.global_step == parts.progress.restored_from == 12
            expected = olds[rank] if world == 4 else resize.merge_own(olds, rank, world, SEED, SHAPES)
            _assert_same(parts.strategy.state.loaded, expected["compression"])
            _assert_same(parts.judge.loaded, expected["guard"])
            assert parts.outages.count == expected["counters"]["outages"]
            assert parts.progress.local_skips == expected["counters"]["local_skips"]
            assert torch.equal(torch.get_rng_state(), olds[rank]["rng"])  # ranks 0..2 existed before
    finally:
        torch.set_rng_state(rng)


# --- real gloo ranks: W = 4 trains and saves, W = 2 and 3 resume -------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _train(model, state, opt, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 8, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        state.allreduce_gradients()  # the hook's reduction without DDP (whose start costs seconds here)
        opt.step()


def _fresh(plan: dict, group=None):
    model = _model()
    state = CompressionState(model, Plan.from_dict(plan), process_group=group, min_compress_numel=16, seed=SEED)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _own(state) -> dict:
    return {"compression": state.state_dict(), "guard": {}, "controller_plan": Plan().to_dict(),
            "rng": torch.get_rng_state(), "grad_scaler": None, "replica": None,
            "counters": {"plan_switches": 0, "outages": 0, "skipped_steps": 0, "lr_ramp_from": None,
                         "loss_scale_overflows": 0, "outer_steps": 0, "local_skips": 0}}


def _four_then_two_and_three(rank: int, world: int, plan: dict, directory: str) -> dict:
    """Four ranks train and checkpoint; then ranks 0-1 and ranks 0-2 each resume it as a
    group of their own (a new process group: what a restarted, smaller worker group has),
    merging all four files, and train on."""
    import torch.distributed as dist

    directory = Path(directory)
    groups = {w: dist.new_group(list(range(w))) for w in (2, 3)}  # every rank takes part in creating each
    model, state, opt = _fresh(plan)
    _train(model, state, opt, rank, 0, 4)
    checkpoint.save_own(directory, rank, _own(state))
    if rank == 0:
        checkpoint.save_shared(directory, model, opt, None, {"global_step": 4, "epoch": 0, "world_size": world})
    out: dict = {"saved": state.state_dict()}
    state.close()
    dist.barrier()
    for new in (2, 3):
        if rank < new:
            model, state, opt = _fresh(plan, groups[new])
            meta, own = checkpoint.load(directory, rank, new, model, opt, None)
            assert own is None and meta["world_size"] == world
            shapes = {n: list(p.shape) for n, p in model.named_parameters()}
            merged = resize.merge_own(checkpoint.load_all_own(directory, world), rank, new, SEED, shapes)
            state.load_state_dict(merged["compression"])
            loaded = state.state_dict()
            _train(model, state, opt, rank, 4, 7)
            state.close()
            out[new] = (loaded, [p.detach().clone() for p in model.parameters()], shapes)
        dist.barrier()
    return out


def test_real_ranks_resume_a_four_rank_checkpoint_on_two_and_three(tmp_path):
    # Top-K with error feedback on one layer, int4 over the scalable route (server
    # residuals at W = 4 and 3, none at 2) on the other
    plan = Plan.per_layer({"0.weight": CompressorSpec.of("topk", ratio=0.05), "2.weight": CompressorSpec.of("int4")})
    ranks = run_distributed(_four_then_two_and_three, 4, plan.to_dict(), str(tmp_path))
    saved = [r["saved"] for r in ranks]
    assert all(s["memory"]["residuals"] for s in saved) and all(s["server_residuals"] for s in saved)
    for world in (2, 3):
        results = [r[world] for r in ranks[:world]]
        shapes = results[0][2]
        owed_before, owed_after = _owed(saved, shapes), _owed([r[0] for r in results], shapes)
        for name in ("0.weight", "2.weight"):
            assert owed_before[name].abs().sum() > 0
        for name in shapes:
            torch.testing.assert_close(owed_after[name], owed_before[name], rtol=0, atol=1e-6)
        for _, params, _ in results[1:]:  # the replicas stay bit-identical
            for a, b in zip(results[0][1], params, strict=True):
                assert torch.equal(a, b)


# --- the controller: a run registered again at another size re-measures and re-plans --------
def _interval(controller, world: int, step: int, totals: list[float], comm: float) -> None:
    for rank in range(world):
        controller.ingest({
            "run_id": "r", "rank": rank, "step": step, "epoch": 0, "plan_version": 0, "loss": 1.0,
            "step_seconds": 0.05 + comm, "compute_seconds": 0.05, "comm_seconds": comm,
            "samples_per_second": 100.0, "wire_bytes": totals[rank], "dense_bytes": totals[rank], "layers": []})


def test_the_controller_learns_the_new_size_and_measures_the_link_again():
    from raycomp.config.policy_options import AdaptiveOptions
    from raycomp.controllers.service import Controller

    controller = Controller()
    options = AdaptiveOptions(warmup="dense").model_dump(mode="json")
    shapes = {"w": [512, 512], "v": [256, 512]}
    controller.register_run("r", 4, shapes, "adaptive", options, 0, 10, 1024)
    per_step = 1e6  # bytes per rank and step at W = 4, in 0.1 s: 1e7 bytes/s
    for step in (9, 19, 29):
        _interval(controller, 4, step, [per_step * (step + 1)] * 4, 0.1)
    cost = controller.policies["r"].cost_models()[0]
    assert cost.bw == pytest.approx(1e7) and cost.compute == pytest.approx(0.05)
    before = controller.runs["r"].plan
    assert not all(before.spec_for(n).is_dense for n in shapes)  # the link made compression pay

    # restarted from the step-19 checkpoint on 3 workers: the byte totals folded by rank mod 3
    controller.register_run("r", 3, shapes, "adaptive", options, 0, 10, 1024)
    run = controller.runs["r"]
    assert run.world_size == 3 and cost.bw is None and cost.compute is None and not cost.overhead
    # re-planned: dense until a dense interval at the new size has timed the link
    assert run.plan.version > before.version and all(run.plan.spec_for(n).is_dense for n in shapes)
    assert any(e["kind"] == "resize" and e["detail"] == "4 -> 3 workers" for e in run.events)
    folded = [per_step * 20 * 2, per_step * 20, per_step * 20]
    new_per_step, new_comm = 0.9e6, 0.3  # 3e6 bytes/s at W = 3
    for step in (29, 39):  # 29: already merged before the restart (dropped); 39: the first new one
        _interval(controller, 3, step, [t + new_per_step * (step - 19) for t in folded], new_comm)
    controller.policies["r"].decide(run)
    assert cost.bw is None  # no sample spans the resize
    _interval(controller, 3, 49, [t + new_per_step * 30 for t in folded], new_comm)
    assert cost.bw == pytest.approx(3e6)
    assert run.wire_bytes == pytest.approx(sum(folded) + 3 * new_per_step * 30)


def test_under_local_steps_a_resize_restarts_every_replica_from_the_global_weights(tmp_path, monkeypatch):
    import ray.train

    olds = _olds(4, local=True)
    _write_checkpoint(tmp_path, olds)
    found = types.SimpleNamespace(path=str(tmp_path), as_directory=lambda: contextlib.nullcontext(str(tmp_path)))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: found)
    rng = torch.get_rng_state()
    try:
        for world, replica_restarted in ((4, False), (2, True)):
            parts = _fake_parts(1, world)
            own_weights = torch.full((4, 5), -1.0)
            parts.strategy.state.steps = types.SimpleNamespace(params=[own_weights],
                                                               global_params=[torch.full((4, 5), 0.25)])
            # the fake replica's keys are not the model's, nor its optimizer's
            parts.strategy.model.load_state_dict = parts.optimizer.load_state_dict = lambda state: None
            resume.restore(parts)
            # the same size: this rank's own replica came back (its file's); another: the global weights
            assert torch.equal(own_weights, torch.full((4, 5), 0.25)) == replica_restarted
    finally:
        torch.set_rng_state(rng)


def test_the_framework_integrations_merge_a_checkpoint_of_another_size_too(tmp_path):
    from raycomp.integrations import state_files

    olds = _olds(4)
    for r, own in enumerate(olds):
        checkpoint.save_own(tmp_path, r, own)
    (tmp_path / checkpoint.META).write_text(json.dumps({"global_step": 12, "world_size": 4}))
    _assert_same(state_files.load_state(tmp_path, 2, 4), olds[2])  # the same size: its own file
    rng = torch.get_rng_state()
    try:
        for rank in range(3):
            parts = _fake_parts(rank, 3)
            state_files.resume_with(state_files.load_state(tmp_path, rank, 3), 12)(parts)
            assert parts.progress.global_step == parts.progress.restored_from == 12
            _assert_same(parts.strategy.state.loaded, resize.merge_own(olds, rank, 3, SEED, SHAPES)["compression"])
    finally:
        torch.set_rng_state(rng)
