"""Real training: DDP + the raycomp hook on sklearn digits across 2 gloo processes.

On this workload Top-K 1% without error feedback comes within a point of dense, so it
cannot show what error feedback is for: that comparison runs at Top-K 0.1%, where dropping
the residuals costs points after 10 epochs and after 20. The tests run seed 0; their bounds
also hold for seed 1 (the accuracies by seed and epoch: docs/benchmarks/history.md).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from jobs.data import digits
from jobs.demo import PLANS, train_digits
from jobs.models import accuracy, mlp
from raycomp import CompressionState, Plan, compression_hook
from tests.distributed import run_distributed

EPOCHS = 20
DENSE_FLOOR = 0.965  # dense measures 0.9749 (seed 0)


@pytest.fixture(scope="module")
def dense():
    result = run_distributed(train_digits, 2, PLANS["dense"].to_dict(), EPOCHS)[0]
    assert result["accuracy"] > DENSE_FLOOR  # the workload itself learns
    return result


@pytest.mark.parametrize("method", ["topk_1pct_ef", "powersgd_r2"])
def test_compressed_training_matches_dense_accuracy_with_30x_fewer_bytes(dense, method):
    result = run_distributed(train_digits, 2, PLANS[method].to_dict(), EPOCHS)[0]
    print(f"{method}: accuracy {result['accuracy']:.4f} (dense {dense['accuracy']:.4f}), "
          f"wire {result['wire_bytes']:.0f} B vs dense {dense['wire_bytes']:.0f} B")
    assert result["accuracy"] >= dense["accuracy"] - 0.01
    assert result["steps"] == dense["steps"]
    assert result["dense_bytes"] == dense["wire_bytes"]  # same dense-equivalent accounting
    assert dense["wire_bytes"] / result["wire_bytes"] >= 30


def _train(rank: int, world_size: int, plan: dict, memory: str, epochs: int = EPOCHS, seed: int = 0) -> dict:
    """jobs.demo's loop, with the error-feedback memory as a parameter."""
    torch.manual_seed(seed)
    train, test = digits(seed=seed)
    shard = train.shard(rank, world_size)
    model = DDP(mlp())
    state = CompressionState(model, Plan.from_dict(plan), memory=memory)
    model.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order_gen = torch.Generator().manual_seed(seed + 1)
    halfway = None
    for epoch in range(epochs):
        order = torch.randperm(len(shard), generator=order_gen)
        for i in range(0, len(shard) - 32 + 1, 32):
            idx = order[i : i + 32]
            loss = torch.nn.functional.cross_entropy(model(shard.x[idx]), shard.y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if epoch + 1 == epochs // 2:
            halfway = accuracy(model.module, test.x, test.y)
    state.close()
    return {"accuracy": accuracy(model.module, test.x, test.y), "halfway": halfway,
            "wire_bytes": state.ledger.wire_total}


def test_top_k_one_in_a_thousand_trains_to_dense_accuracy_only_with_error_feedback(dense):
    plan = Plan.uniform("topk", ratio=0.001).to_dict()
    with_ef = run_distributed(_train, 2, plan, "residual")[0]
    without = run_distributed(_train, 2, plan, "none")[0]
    print(f"Top-K 0.1%: with EF {with_ef['halfway']:.4f} -> {with_ef['accuracy']:.4f}, without "
          f"{without['halfway']:.4f} -> {without['accuracy']:.4f}, dense {dense['accuracy']:.4f}; "
          f"{dense['wire_bytes'] / with_ef['wire_bytes']:.0f}x fewer bytes")
    assert with_ef["accuracy"] >= dense["accuracy"] - 0.01  # measured +0.3 (seed 1: -0.3)
    assert without["halfway"] <= with_ef["halfway"] - 0.04  # measured -12.3 (seed 1: -5.6)
    assert without["accuracy"] <= with_ef["accuracy"] - 0.015  # measured -3.6 (seed 1: -1.7)
    assert without["wire_bytes"] == with_ef["wire_bytes"]  # same bytes: only the memory differs
    assert dense["wire_bytes"] / with_ef["wire_bytes"] >= 150
