"""The environment of Ray in the tests: what every Ray worker starts with, and what the
test session sets before anything imports ray (tests/conftest.py says why)."""

from __future__ import annotations

from tests.support.repo import REPO

__all__ = ["RAY_TEST_ENV", "SESSION_ENV"]

# faster, quieter Ray Train for tests (see shared field notes)
RAY_TEST_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "120",
    "PYTHONPATH": str(REPO),
}
#: set for the whole session before anything imports ray (see tests/conftest.py)
SESSION_ENV = {**{k: v for k, v in RAY_TEST_ENV.items() if k != "PYTHONPATH"}, "RAY_AUTH_MODE": "token"}
