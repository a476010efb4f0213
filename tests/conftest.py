"""One real local Ray cluster shared by every test that needs it (started on first use).

Isolation between test files (any order, any ``-k`` selection, each file alone):

* Ray reads some settings from the environment once, when ``ray`` (its C++ ``RayConfig``)
  is first imported, and several test modules import it at collection time, before any
  fixture runs. So the environment every test relies on is set here, at conftest import,
  which pytest does before it imports any test module. In particular ``RAY_AUTH_MODE``:
  Ray 2.60 caches it at import (``ray._raylet.get_authentication_mode()`` does not read the
  environment again) and its HTTP clients (``JobSubmissionClient``) add the token header
  only if the cached mode is ``token``; a fixture that set it later had no effect once
  another file had imported ray, which is what made the Jobs test fail with "Missing
  authentication token" depending on which files were collected. ``token`` is also what
  ``ray.init()`` switches this process to for a new local cluster (it sets the variable
  itself), so fixing it up front only removes the dependence on which test ran first.
* The Jobs test's cluster has its own token and its client sends it explicitly (see
  tests/test_ray_jobs.py), so it depends neither on this process's cached token nor on
  ``~/.ray/auth_token``, which every Ray user and test session on the machine shares.
* ``ray_cluster`` is session-scoped and starts from a clean slate (a stray ``ray.init``
  left by a test that ran without the fixture is shut down first); actor names that tests
  create in it are unique per test.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.ray_env import RAY_TEST_ENV, SESSION_ENV
from tests.support.repo import REPO

os.environ.update(SESSION_ENV)
if "ray._raylet" in sys.modules:  # imported before this conftest (a plugin): refresh its cached config
    from ray._raylet import Config

    Config.initialize("")  # what ray itself does after it sets RAY_AUTH_MODE (_enable_token_auth)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.update(RAY_TEST_ENV)
    os.environ.pop("RAY_ADDRESS", None)  # always the embedded cluster, never a user's
    if ray.is_initialized():  # left over by a test that ran jobs.train/jobs.tune without this fixture
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": RAY_TEST_ENV}, namespace="raycomp-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def digits_in_turn(request, ray_cluster, tmp_path_factory):
    """The ``IN_TURN`` runs the selected tests read, trained in turn in one Ray Train fit
    (:mod:`tests.support.runs_in_turn`), keyed ``"<module>:<name>"``."""
    from tests.support.runs_in_turn import collected_runs, train_in_turn

    return train_in_turn(tmp_path_factory.mktemp("in-turn"), str(REPO / "jobs" / "configs" / "digits.yaml"),
                         collected_runs(request.session.items))


@pytest.fixture(scope="module")
def in_turn(request, digits_in_turn):
    """This module's ``IN_TURN`` runs' summaries, by name."""
    from tests.support.runs_in_turn import runs_of

    return runs_of(request.module.__name__, digits_in_turn)
