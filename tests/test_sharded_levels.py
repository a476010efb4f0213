"""FSDP2 in two levels (:mod:`raycomp._internal.fsdp.two_level`) on 4 real gloo processes, 2 nodes x 2:
units sharded over each node's group, dense inside the node, each shard's mean across nodes
compressed as the plan says."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from raycomp.plan import CompressorSpec, Plan
from tests.distributed import run_distributed
from tests.support.fsdp_mlp import IN, OUT, local_norm, mlp, mlp_batch, reference_mean_grads

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
INT8 = Plan.per_layer({"0": CompressorSpec.of("int8"), "2": CompressorSpec.of("int8")})


def _per_node(levels) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from raycomp._internal.fsdp.two_level import node_mesh

    model, mesh = mlp(), node_mesh(levels, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _two_level_steps(rank, world, plans, nan_at=None):
    """One backward and SGD step per plan; per step the full gradients, the collectives by
    group size, the ledger and the node's bytes, the control rows, the guard's norm and the
    statistics; then the state and a refused resume."""
    import torch.distributed as dist

    from raycomp._internal.fsdp.state import ShardedState
    from raycomp._internal.topology import Topology, node_groups
    from tests.support.wire import WireRecorder

    levels = node_groups(Topology.of_rank(rank, NODES, PER_NODE))
    model = _per_node(levels)
    state = ShardedState(model, stats_every=2, levels=levels)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"steps": [], "per_node": state.per_node}
    for step, plan in enumerate(plans):
        state.set_plan(Plan.from_dict(plan))
        state.stage_control([10.0 * rank + step, 1.0, 0.5])
        x, y = mlp_batch(rank, step)
        if step == nan_at and rank == 3:
            x = x * float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        wire_before, intra_before = state.ledger.wire_total, state.intra_bytes
        with WireRecorder() as wire:
            loss.backward()
            state.end_backward()
        level = {levels.intra.handle.group_name: "node", levels.cross.handle.group_name: "cross"}
        calls = [(c.op, str(c.dtype), level.get(c.group, "world"), c.transmitted) for c in wire.calls]
        out["steps"].append({
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "calls": calls, "ledger": state.ledger.wire_total - wire_before,
            "intra": state.intra_bytes - intra_before,
            "rows": state.control_rows.tolist(), "norm": state.gradient_norm([]),
            "stats": [(s.layer, s.compressor, s.numel) for s in state.stats] if state.stats_step == step else None})
        if step == nan_at:  # what the loop does when the guard skips a step
            out["kept_after_nan"] = sorted(state.cross.reducer.memory.state_dict()["residuals"])
            state.discard_step()
        elif step > 0:  # steps 0 and 1 at the initial weights, as the reference
            optimizer.step()
        model.zero_grad(set_to_none=True)
    out["weights"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["residuals"] = state.cross.reducer.memory.state_dict()["residuals"]
    saved = state.state_dict()
    out["state_keys"] = sorted(saved)
    fresh = ShardedState(_per_node(levels), levels=levels)
    fresh.load_state_dict(saved)
    again = fresh.state_dict()["cross"]
    out["round_trip"] = again["step"] == saved["cross"]["step"] and all(
        torch.equal(t, saved["cross"]["memory"]["residuals"][k]) for k, t in again["memory"]["residuals"].items())
    flat = {**saved}
    flat.pop("cross")
    errors = []
    for bad in (flat, {**saved, "cross": {**saved["cross"], "levels": {**saved["cross"]["levels"], "position": 9}}}):
        try:
            ShardedState(_per_node(levels), levels=levels).load_state_dict(bad)
        except ValueError as error:
            errors.append(str(error))
    out["errors"] = errors
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def dense_then_int8():
    plans = [Plan().to_dict(), INT8.to_dict(), INT8.to_dict(), INT8.to_dict()]
    return run_distributed(_two_level_steps, WORLD, plans, 3, timeout=240)


def test_a_dense_plan_gives_every_rank_the_mean_of_all_four(dense_then_int8):
    reference = reference_mean_grads(WORLD, 0)
    for result in dense_then_int8:
        grads = result["steps"][0]["grads"]
        for name, ref in reference.items():
            assert torch.allclose(grads[name], ref, atol=1e-6), name


def test_an_int8_plan_is_close_to_the_mean_and_every_node_holds_the_same_weights(dense_then_int8):
    reference = reference_mean_grads(WORLD, 1)
    for result in dense_then_int8:
        grads = result["steps"][1]["grads"]
        errors = {n: float((grads[n] - ref).norm() / ref.norm()) for n, ref in reference.items()}
        assert max(errors.values()) < 3e-2, errors
        assert errors["0.weight"] > 1e-7  # lossy: not the exact mean
    first = dense_then_int8[0]
    for other in dense_then_int8[1:]:  # the replicas of both nodes, bit for bit
        for name, weight in first["weights"].items():
            assert torch.equal(weight, other["weights"][name]), name


def test_only_the_shards_cross_nodes_and_the_ledgers_are_what_reached_the_wire(dense_then_int8):
    sizes = {"0": IN * 96 + 96, "2": 96 * 80 + 80, "4": 80 * OUT + OUT}
    for result in dense_then_int8:
        assert result["per_node"] == PER_NODE
        dense, int8 = result["steps"][0], result["steps"][1]
        for step in (dense, int8):
            gathers = [c for c in step["calls"] if c[0] == "all_gather_single"]
            assert {c[2] for c in gathers} == {"node"}  # FSDP's parameters: gathered inside the node only
            calls = [c for c in step["calls"] if c[0] != "all_gather_single"]
            inside = [c for c in calls if c[2] == "node"]
            across = [c for c in calls if c[2] == "cross"]
            # every unit: one fp32 exchange of its whole gradient inside the node, as bytes
            assert [(c[0], c[1]) for c in inside] == [("all_to_all_single", "torch.uint8")] * 3, inside
            assert step["intra"] == pytest.approx(sum(c[3] for c in inside))
            assert step["intra"] == pytest.approx(sum((PER_NODE - 1) / PER_NODE * 4 * n for n in sizes.values()))
            assert step["ledger"] == pytest.approx(sum(c[3] for c in across)), (across, step["ledger"])
            # the control rows: one small all-reduce over every rank, the only such call
            assert [c[:3] for c in calls if c[2] == "world"] == [("all_reduce", "torch.float32", "world")], calls
        # dense: each shard (half a unit) all-reduced across the 2 nodes in fp32
        assert dense["ledger"] == pytest.approx(sum(2 * (NODES - 1) / NODES * 4 * n / PER_NODE for n in sizes.values()))
        # int8: "0" and "2" a byte an element (and a scale per chunk); "4" under min_compress_numel
        ratio = int8["ledger"] / dense["ledger"]
        small = 2 * (NODES - 1) / NODES * 4 * sizes["4"] / PER_NODE
        assert 0.25 < (int8["ledger"] - small) / (dense["ledger"] - small) < 0.27, ratio


def test_every_rank_holds_every_ranks_control_row_and_a_nan_is_flagged_on_its_step(dense_then_int8):
    own = [local_norm(r, 0) for r in range(WORLD)]
    for step in range(3):
        rows = [r["steps"][step]["rows"] for r in dense_then_int8]
        assert all(r == rows[0] for r in rows)
        assert [row[1] for row in rows[0]] == [10.0 * r + step for r in range(WORLD)]
        assert all(row[0] == 0.0 for row in rows[0])
    for result in dense_then_int8:
        assert result["steps"][0]["norm"] == pytest.approx(math.sqrt(sum(n * n for n in own) / WORLD), rel=1e-5)
    for result in dense_then_int8:  # rank 3's NaN at step 3
        last = result["steps"][3]
        assert [row[0] for row in last["rows"]] == [0.0, 0.0, 0.0, 1.0]
        assert not math.isfinite(last["norm"])


def test_statistics_and_residuals_are_the_shards_and_the_state_resumes_only_at_its_place(dense_then_int8):
    sizes = {"0": IN * 96 + 96, "2": 96 * 80 + 80, "4": 80 * OUT + OUT}
    for result in dense_then_int8:
        stats = result["steps"][1]["stats"]
        assert stats is not None and {s[0] for s in stats} == set(sizes)
        assert {s[0]: s[1] for s in stats} == {"0": "int8", "2": "int8", "4": "none"}
        assert {s[0]: s[2] for s in stats} == {n: size // PER_NODE for n, size in sizes.items()}
        assert result["steps"][0]["stats"] is None
        assert "cross" in result["state_keys"] and result["round_trip"]
        flat, moved = result["errors"]
        assert flat.startswith("compression.levels: this checkpoint was written in one level")
        assert "allowed: resume at the same nodes x ranks per node" in moved
    # rank 3's NaN at step 3 reached node 1's shards before they were sent: their residuals
    # are dropped there at once; node 0's shards were finite until the mean, so the guard's
    # skip (discard_step, on every rank) drops theirs
    assert [r["kept_after_nan"] for r in dense_then_int8] == [["0", "2"], ["0", "2"], [], []]
    assert all(r["residuals"] == {} for r in dense_then_int8)


def _residual_run(rank, world):
    from raycomp._internal.fsdp.state import ShardedState
    from raycomp._internal.topology import Topology, node_groups

    levels = node_groups(Topology.of_rank(rank, NODES, PER_NODE))
    model = _per_node(levels)
    state = ShardedState(model, plan=INT8, levels=levels)
    x, y = mlp_batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    state.end_backward()
    memory = state.cross.reducer.memory.state_dict()["residuals"]
    return {name: (tuple(t.shape), float(t.abs().sum())) for name, t in memory.items()}


def test_each_rank_keeps_the_residual_of_its_own_shard_only():
    for result in run_distributed(_residual_run, WORLD, timeout=180):
        assert set(result) == {"0", "2"}  # the int8 units; "4" went dense
        assert result["0"][0] == ((IN * 96 + 96) // PER_NODE,) and result["0"][1] > 0
        assert result["2"][0] == ((96 * 80 + 80) // PER_NODE,) and result["2"][1] > 0


def test_levels_without_the_cross_node_hop_are_refused():
    from raycomp._internal.fsdp.state import ShardedState
    from raycomp._internal.topology import Levels, Topology

    with pytest.raises(ValueError, match="install: a model sharded per node needs raycomp's cross-node hop"):
        ShardedState(nn.Linear(2, 2), install=False, levels=Levels(Topology(2, 2), None, None))  # type: ignore[arg-type]

