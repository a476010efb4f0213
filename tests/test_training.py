"""Real training: DDP + the raycomp hook on sklearn digits across 2 gloo processes.

Top-K 1% with error feedback and PowerSGD rank 2 must reach dense accuracy within one
point while putting at least 30x fewer bytes on the wire.
"""

from __future__ import annotations

import pytest

from jobs.demo import PLANS, train_digits
from tests.distributed import run_distributed

EPOCHS = 20


@pytest.fixture(scope="module")
def dense():
    return run_distributed(train_digits, 2, PLANS["dense"].to_dict(), EPOCHS)[0]


@pytest.mark.parametrize("method", ["topk_1pct_ef", "powersgd_r2"])
def test_compressed_training_matches_dense_accuracy_with_30x_fewer_bytes(dense, method):
    result = run_distributed(train_digits, 2, PLANS[method].to_dict(), EPOCHS)[0]
    print(f"{method}: accuracy {result['accuracy']:.4f} (dense {dense['accuracy']:.4f}), "
          f"wire {result['wire_bytes']:.0f} B vs dense {dense['wire_bytes']:.0f} B")
    assert dense["accuracy"] > 0.93  # the workload itself learns
    assert result["accuracy"] >= dense["accuracy"] - 0.01
    assert result["steps"] == dense["steps"]
    assert result["dense_bytes"] == dense["wire_bytes"]  # same dense-equivalent accounting
    assert dense["wire_bytes"] / result["wire_bytes"] >= 30
