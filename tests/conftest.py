"""One real local Ray cluster shared by every test that needs it (started on first use)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# faster, quieter Ray Train for tests (see shared field notes)
RAY_TEST_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "120",
    "PYTHONPATH": str(REPO),
}


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.update(RAY_TEST_ENV)
    os.environ.pop("RAY_ADDRESS", None)  # always the embedded cluster, never a user's
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": RAY_TEST_ENV}, namespace="raycomp-tests")
    yield ray
    ray.shutdown()
