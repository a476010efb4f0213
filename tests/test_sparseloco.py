"""SparseLoCo (Sarfi et al. 2025): chunked Top-K of the pseudo-gradient, 2-bit values, error
feedback in place of outer momentum, as ``compression.local.compressor: sparseloco``.

The format and its bytes are checked on the compressor, then at torch.distributed (every
collective recorded by ``tests.support.wire``): a sync's all-gather carries exactly
``payload_bytes`` of every layer, which the ledger counts. What compression drops, the
unsent elements and the 2-bit rounding of the sent ones, stays in the error-feedback
residual; with the recipe's plain outer step (SGD, lr 1, no momentum) nothing is lost
across syncs: the global weights moved by the sum of the mean pseudo-gradients less the
mean residual still held. Local steps with it leave every rank with one model after each
sync at W = 2 and 4, and in two levels (2 nodes x 2 ranks) the pseudo-gradient crosses
nodes compressed; a checkpoint mid-interval resumes bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raycomp import CompressionState, Plan, compression_hook
from raycomp._internal.local import LocalSteps
from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.reduce.two_level import TwoLevelReducer
from raycomp._internal.topology import Topology
from raycomp._internal.train.local_strategy import LocalState
from raycomp.compressors import COMPRESSORS, Transport, make_compressor
from raycomp.compressors.sparseloco import SparseLoCo
from raycomp.config import CompressionSection, LocalSection
from raycomp.plan import CompressorSpec, LocalMode
from tests.distributed import run_distributed
from tests.support.ranks import flat, gather
from tests.support.wire import WireRecorder, transmitted_bytes

SYNC_EVERY, STEPS = 4, 12
NODES, PER_NODE = 2, 2


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _kept_per_chunk(n: int, chunk: int, ratio: float) -> list[int]:
    """The documented count: ``max(1, ceil(ratio * length))`` of each chunk, the last by its own."""
    return [max(1, math.ceil(ratio * min(chunk, n - start))) for start in range(0, n, chunk)]


# --- the compressor ------------------------------------------------------------------------
def test_registered_all_gathered_biased_and_outside_the_adaptive_ladders():
    c = make_compressor("sparseloco")
    assert COMPRESSORS["sparseloco"] is SparseLoCo and c.transport is Transport.ALLGATHER
    assert c.params() == {"ratio": 0.0156, "chunk_size": 4096}
    assert c.error_feedback and not c.unbiased and not c.variable_size
    assert SparseLoCo.cost is not None and not SparseLoCo.cost.near_lossless


def test_wire_bytes_at_the_defaults_hand_computed():
    c = make_compressor("sparseloco")
    # a chunk of 4096 keeps ceil(63.9) = 64: 64 uint16 positions, 16 bytes of 2-bit codes, two fp32
    assert c.payload_bytes(4096, (4096,), 4.0) == 64 * 2 + 16 + 8 == 152
    # 2**20 elements: 256 chunks of 152 bytes, 38,912 against 4 MiB of fp32 (108x, 0.037 B/element)
    assert c.payload_bytes(1 << 20, (1 << 20,), 4.0) == 256 * 152 == 38_912
    # a short last chunk keeps by its own length: 4097 = 4096 + 1 -> 64 + 1 kept, two chunks
    assert c.payload_bytes(4097, (4097,), 4.0) == 65 * 2 + 17 + 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 4096, 4097, 10_000])
def test_payload_bytes_are_what_the_payload_holds(n, dtype):
    c = make_compressor("sparseloco")
    payload = c.compress(_randn(n).to(dtype))
    assert payload.nbytes == c.payload_bytes(n, (n,), dtype.itemsize)
    k = sum(_kept_per_chunk(n, 4096, 0.0156))
    assert payload.tensors["positions"].dtype == torch.uint16 and payload.tensors["positions"].numel() == k
    assert payload.tensors["codes"].numel() == math.ceil(k / 4)
    assert payload.tensors["magnitudes"].shape == (math.ceil(n / 4096), 2)
    out = c.decompress(payload)
    assert out.dtype == dtype and out.shape == (n,)


def test_positions_are_int32_past_a_uint16_chunk():
    c = SparseLoCo(ratio=0.001, chunk_size=70_000)
    payload = c.compress(_randn(140_000))
    assert payload.tensors["positions"].dtype == torch.int32
    assert payload.nbytes == c.payload_bytes(140_000, (140_000,), 4.0) == 2 * 70 * 4 + math.ceil(140 / 4) + 16


def test_each_chunk_keeps_its_own_largest_even_beside_a_louder_chunk():
    """Top-K per chunk, not of the tensor: a quiet chunk sends as many as a loud one."""
    chunk, ratio = 256, 0.05
    x = _randn(3 * chunk + 100, seed=1)
    x[:chunk] *= 1000  # a global Top-K would take every value from here
    c = SparseLoCo(ratio=ratio, chunk_size=chunk)
    out = c.decompress(c.compress(x))
    for i, k in enumerate(_kept_per_chunk(x.numel(), chunk, ratio)):
        part, sent = x[i * chunk:(i + 1) * chunk], out[i * chunk:(i + 1) * chunk]
        expected = set(torch.topk(part.abs(), k).indices.tolist())
        assert set(torch.nonzero(sent).squeeze(1).tolist()) == expected, i
        assert torch.equal(torch.sign(sent[sorted(expected)]), torch.sign(part[sorted(expected)]))


def test_two_bits_a_value_the_two_magnitudes_are_the_means_of_the_halves():
    chunk, ratio = 512, 0.05
    x = _randn(2 * chunk, seed=2)
    c = SparseLoCo(ratio=ratio, chunk_size=chunk)
    out = c.decompress(c.compress(x))
    for i in range(2):
        part, sent = x[i * chunk:(i + 1) * chunk], out[i * chunk:(i + 1) * chunk]
        kept = torch.nonzero(sent).squeeze(1)
        magnitude = part[kept].abs()
        high = magnitude > (magnitude.min() + magnitude.max()) / 2
        assert 0 < int(high.sum()) < kept.numel()  # both magnitudes in use
        expected = torch.where(high, magnitude[high].mean(), magnitude[~high].mean())
        torch.testing.assert_close(sent[kept].abs(), expected, rtol=1e-6, atol=0)
        assert sent[kept].abs().unique().numel() == 2
        assert not torch.equal(sent[kept], part[kept])  # the 2-bit rounding loses something


def test_the_gathered_sum_is_the_sum_of_the_decoded_payloads():
    c = SparseLoCo(ratio=0.05, chunk_size=256)
    payloads = [c.compress(_randn(1000, seed=s)) for s in range(3)]
    total = c.sum_gathered(payloads)
    torch.testing.assert_close(total, sum(c.decompress(p) for p in payloads), rtol=0, atol=1e-6)


def test_the_recipe_is_one_setting_and_its_contradictions_are_refused():
    section = CompressionSection.model_validate({"local": {"mode": "fixed", "compressor": "sparseloco"}})
    assert section.memory == "residual"  # the error feedback
    assert (section.local.outer_lr, section.local.outer_momentum, section.local.nesterov) == (1.0, 0.0, False)
    with pytest.raises(ValueError, match="outer_momentum: must be 0 with compressor 'sparseloco'"):
        LocalSection(mode="fixed", compressor="sparseloco", outer_momentum=0.9)
    with pytest.raises(ValueError, match="memory: 'none' drops the error feedback"):
        CompressionSection.model_validate({"memory": "none", "local": {"mode": "fixed", "compressor": "sparseloco"}})


# --- at torch.distributed ----------------------------------------------------------------
def _model() -> nn.Module:
    # 2048, 6144 (a chunk of 4096 and a short one of 2048) and 960 weights at the defaults
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _reducer_check(rank: int) -> dict:
    """One reduction, then a second: what the residual holds after each."""
    compressor = SparseLoCo(ratio=0.05, chunk_size=256)
    reducer = CompressedReducer(Plan.uniform("sparseloco", ratio=0.05, chunk_size=256), min_compress_numel=0)
    out = []
    residual = None
    for step in range(2):
        grad = _randn(1000, seed=10 * rank + step)
        compensated = grad if residual is None else grad + residual
        reducer.reduce(["g"], [grad])
        reducer.end_step()
        residual = reducer.memory.residual("g").clone()
        sent = compressor.decompress(compressor.compress(compensated))
        out.append({"compensated": compensated, "sent": sent, "residual": residual})
    return {"reducer": out}


def _local_run(rank: int, world: int, memory: str = "residual") -> dict:
    """The recipe: local SGD steps, syncs of ``sparseloco`` at its defaults, outer SGD lr 1."""
    out = _reducer_check(rank) if memory == "residual" else {}
    model = _model()
    steps = LocalSteps(model, sync_every=SYNC_EVERY, plan=Plan.uniform("sparseloco"), memory=memory,
                       outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0), min_compress_numel=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = flat(steps.global_params).clone()
    pseudo_sum = torch.zeros_like(start)
    syncs, weights = [], []
    with WireRecorder() as recorder:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            due = (step + 1) % SYNC_EVERY == 0
            if due:  # this rank's pseudo-gradient of the sync about to run, and the mean of all
                pseudo = flat(steps.global_params) - flat(steps.params)
                pseudo_sum += torch.stack(gather(pseudo)).mean(0)
            mark, ledger = recorder.mark(), steps.reducer.ledger.wire_total
            steps.step()
            calls = recorder.since(mark)
            weights.append(flat(model.parameters()).clone())
            if due:
                residual = flat(steps.reducer.memory.residual(n) if steps.reducer.memory.residual(n) is not None
                                 else torch.zeros_like(p) for n, p in zip(steps.names, steps.params, strict=True))
                syncs.append({
                    "step": step,
                    "calls": [(c.op, c.dtype, c.numel) for c in calls],
                    "recorded": sum(transmitted_bytes(c) for c in calls),
                    "ledger": steps.reducer.ledger.wire_total - ledger,
                    "moved": start - flat(steps.global_params),
                    "pseudo_sum": pseudo_sum.clone(),
                    "mean_residual": torch.stack(gather(residual)).mean(0),
                })
            else:
                assert not calls, (step, calls)
    shapes = [tuple(p.shape) for p in steps.params]
    return {**out, "syncs": syncs, "weights": weights, "shapes": shapes, "outer": steps.outer_steps}


@pytest.fixture(scope="module")
def flat_runs() -> dict[int, list[dict]]:
    return {w: run_distributed(_local_run, w) for w in (2, 4)}


def test_the_residual_keeps_the_unsent_elements_and_the_two_bit_rounding(flat_runs):
    for rank in flat_runs[2]:
        for record in rank["reducer"]:
            compensated, sent, residual = record["compensated"], record["sent"], record["residual"]
            torch.testing.assert_close(sent + residual, compensated, rtol=0, atol=1e-6)
            kept = sent != 0
            assert 0 < int(kept.sum()) < compensated.numel()
            assert torch.equal(residual[~kept], compensated[~kept])  # the unsent, whole
            assert residual[kept].abs().min() >= 0 and residual[kept].abs().max() > 1e-3  # the rounding, fed back
            torch.testing.assert_close(residual[kept], compensated[kept] - sent[kept], rtol=0, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_a_sync_puts_exactly_the_payload_bytes_on_the_wire(flat_runs, world):
    c = make_compressor("sparseloco")
    for rank in flat_runs[world]:
        payload = sum(c.payload_bytes(math.prod(s), s, 4.0) for s in rank["shapes"])
        assert len(rank["syncs"]) == STEPS // SYNC_EVERY
        for sync in rank["syncs"]:
            assert sync["calls"] == [("all_gather", torch.uint8, payload)], sync["calls"]  # one, packed bytes
            assert sync["recorded"] == (world - 1) * payload
            assert sync["ledger"] == pytest.approx(sync["recorded"], rel=1e-12)
            dense = 2 * (world - 1) / world * 4 * sum(math.prod(s) for s in rank["shapes"])
            assert sync["recorded"] < dense / 20


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_one_model_after_each_sync_and_drifts_between(flat_runs, world):
    ranks = flat_runs[world]
    for step in range(STEPS):
        at = [r["weights"][step] for r in ranks]
        same = all(torch.equal(w, at[0]) for w in at)
        assert same == ((step + 1) % SYNC_EVERY == 0), step
    assert [r["outer"] for r in ranks] == [STEPS // SYNC_EVERY] * world


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_replaces_momentum_nothing_dropped_is_lost(flat_runs, world):
    """Plain averaging of what was sent: the global weights moved by every mean pseudo-gradient
    so far less what the ranks still hold back, which the next sync sends first."""
    for rank in flat_runs[world]:
        for sync in rank["syncs"]:
            torch.testing.assert_close(sync["moved"] + sync["mean_residual"], sync["pseudo_sum"], rtol=0, atol=1e-5)
            assert sync["mean_residual"].abs().max() > 1e-4  # something was held back
        first, second = rank["syncs"][:2]
        # the second sync sent its own pseudo-gradient plus what the first held back, less
        # what it holds back itself
        sent = second["moved"] - first["moved"]
        own = second["pseudo_sum"] - first["pseudo_sum"]
        torch.testing.assert_close(sent - own + second["mean_residual"], first["mean_residual"], rtol=0, atol=1e-5)


def test_without_memory_what_a_sync_drops_is_lost():
    ranks = run_distributed(_local_run, 2, "none")
    gap = max(float((s["moved"] - s["pseudo_sum"]).abs().max()) for s in ranks[0]["syncs"])
    last = ranks[0]["syncs"][-1]
    assert gap > 1e-3 and float(last["mean_residual"].abs().max()) == 0.0


def _resumed(rank: int, world: int, resume_at: int | None) -> list[torch.Tensor]:
    """The recipe with a momentum inner SGD; at ``resume_at`` (mid-interval) everything is
    rebuilt from a checkpoint of the model, the optimizer and the local steps."""
    def build():
        model = _model()
        steps = LocalSteps(model, sync_every=SYNC_EVERY, plan=Plan.uniform("sparseloco"),
                           outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0), min_compress_numel=0)
        return model, steps, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, steps, optimizer = build()
    weights = []
    for step in range(STEPS):
        if step == resume_at:
            saved = (model.state_dict(), optimizer.state_dict(), steps.state_dict())
            assert saved[2]["reducer"]  # the residuals travel with it
            model, steps, optimizer = build()
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            steps.load_state_dict(saved[2])
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps.step()
        weights.append(flat(model.parameters()).clone())
    return weights


def test_a_checkpoint_mid_interval_resumes_bit_for_bit():
    unbroken = run_distributed(_resumed, 2, None)
    resumed = run_distributed(_resumed, 2, 6)  # two inner steps after a sync with a residual held
    for a, b in zip(unbroken, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(unbroken[0][5], unbroken[1][5])  # the ranks had drifted when saved


# --- two levels: a node is a replica -----------------------------------------------------
def _build_two_levels(topology: Topology, pseudo: str) -> tuple:
    """Node replicas (DDP inside the node), syncs of ``pseudo`` across nodes, outer SGD lr 1."""
    model = DDP(_model(), bucket_cap_mb=0.01)
    state = CompressionState(model, Plan(), min_compress_numel=0, topology=topology)
    model.register_comm_hook(state, compression_hook)
    assert isinstance(state.reducer, TwoLevelReducer)
    steps = LocalSteps(model.module, sync_every=SYNC_EVERY, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                       min_compress_numel=0, levels=state.reducer.levels)
    local = LocalState(model, state, steps, LocalSection(delay=0))
    local.set_plan(Plan(default=CompressorSpec.of(pseudo), local=LocalMode(SYNC_EVERY, 1)))
    return model, state, steps, local, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _two_levels(rank: int, world: int, pseudo: str) -> dict:
    model, state, steps, local, optimizer = _build_two_levels(Topology.of_rank(rank, NODES, PER_NODE), pseudo)
    cross = state.reducer.levels.cross.handle.group_name
    weights, cross_calls = [], []
    with WireRecorder() as recorder:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            mark = recorder.mark()
            steps.step()
            cross_calls += [(c.op, c.dtype, transmitted_bytes(c)) for c in recorder.since(mark) if c.group == cross]
            weights.append(flat(model.parameters()).clone())
    out = {"weights": weights, "cross_calls": cross_calls, "wire": state.ledger.wire_total,
           "outer": steps.outer_steps}
    local.close()
    return out


def test_in_two_levels_the_pseudo_gradient_crosses_nodes_compressed():
    ranks = run_distributed(_two_levels, NODES * PER_NODE, "sparseloco")
    dense = run_distributed(_two_levels, NODES * PER_NODE, "none")
    for rank, plain in zip(ranks, dense, strict=True):
        assert rank["outer"] == STEPS // SYNC_EVERY
        assert rank["cross_calls"] and all(op == "all_gather" and dtype == torch.uint8
                                           for op, dtype, _ in rank["cross_calls"]), rank["cross_calls"]
        crossed = sum(b for *_, b in rank["cross_calls"])
        assert rank["wire"] == pytest.approx(crossed)  # the ledger counts the cross-node bytes
        assert 0 < crossed < plain["wire"] / 20
    for step in range(STEPS):
        at = [r["weights"][step] for r in ranks]
        for node in range(NODES):  # a node's ranks stay equal
            assert torch.equal(at[node * PER_NODE], at[node * PER_NODE + 1]), step
        assert all(torch.equal(w, at[0]) for w in at) == ((step + 1) % SYNC_EVERY == 0), step
