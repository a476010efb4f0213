"""Ray Jobs against a real `ray start --head` cluster with token authentication on.

The cluster is this module's own: its own ports, temp dir and auth token, so an embedded
test cluster or anyone else's Ray on the machine is left alone, and it is torn down (its
processes only, by process id) even when a test fails.

Token auth is switched on explicitly (`RAY_AUTH_MODE=token` and a token file of its own for
`ray start`): left to itself, `ray start` turns it on only if `~/.ray/auth_token` happens
to exist, so the test would check auth on one machine and not on another. The client sends
that token explicitly in its `Authorization` header, as a user of a remote cluster does:
the alternative, `RAY_AUTH_MODE=token` in this process, is read by Ray once at import
(see tests/conftest.py) and would pick up this process's cached token (the embedded test
cluster's, from `~/.ray/auth_token`) rather than this cluster's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.ray_env import RAY_TEST_ENV
from tests.support.repo import REPO

BIN = Path(sys.executable).parent
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# Ray Train speed-ups for the job's actors (not PYTHONPATH: the job must find raycomp
# through its working_dir, as on a cluster node that has only Ray and torch).
JOB_ENV = {k: v for k, v in RAY_TEST_ENV.items() if k != "PYTHONPATH"}


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _processes() -> dict[int, tuple[int, str]]:
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        table[int(entry)] = (ppid, cmdline)
    return table


def _cluster_pids(temp_dir: str) -> set[int]:
    """Processes of the cluster started with --temp-dir=temp_dir, and all their descendants."""
    table = _processes()
    mine = {os.getpid(), os.getppid()}
    pids = {pid for pid, (_, cmd) in table.items() if temp_dir in cmd and pid not in mine}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in table.items():
            if ppid in pids and pid not in pids and pid not in mine:
                pids.add(pid)
                grew = True
    return pids


def _stop_cluster(temp_dir: str) -> None:
    """What `ray stop --force` does, for this cluster's processes only."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = _cluster_pids(temp_dir)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and _cluster_pids(temp_dir):
            time.sleep(0.2)


@pytest.fixture(scope="module")
def head_node():
    """`ray start --head` with a dashboard (the job API) on free ports and token auth with a
    token of its own; yields (address, token)."""
    temp_dir = tempfile.mkdtemp(prefix="rcjobs-", dir="/tmp")  # short: Unix socket paths
    gcs, dashboard, *others = _free_ports(10)
    token = secrets.token_hex(32)
    token_file = Path(temp_dir) / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "RAY_AUTH_TOKEN")}
    # `python` in an entrypoint is the venv's, as for a user who activated it; the cluster's
    # processes (and so the job's driver) inherit the auth settings
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    flags = dict(zip(("--ray-client-server-port", "--dashboard-agent-listen-port",
                      "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                      "--metrics-export-port", "--node-manager-port", "--object-manager-port"),
                     map(str, others), strict=False))
    command = [str(BIN / "ray"), "start", "--head", "--port", str(gcs), "--dashboard-port", str(dashboard),
               "--dashboard-host", "127.0.0.1", "--include-dashboard=true", "--num-cpus", "2",
               "--temp-dir", temp_dir, "--disable-usage-stats",
               *[item for pair in flags.items() for item in pair]]
    try:
        started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        assert started.returncode == 0, f"ray start failed:\n{started.stdout}\n{started.stderr}"
        yield f"http://127.0.0.1:{dashboard}", token
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not _cluster_pids(temp_dir), "the test cluster left processes behind"


def _client(head_node):
    from ray.job_submission import JobSubmissionClient

    address, token = head_node
    return JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})


def test_the_job_api_refuses_requests_without_the_token(head_node):
    address, token = head_node
    for headers, status in (({}, 401), ({"Authorization": "Bearer " + "0" * 64}, 403)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{address}/api/jobs/", headers=headers), timeout=30)
        assert refused.value.code == status, (headers, refused.value)
    request = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200


def _wait(client, job_id: str, timeout_s: float = 420) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
        if status in TERMINAL:
            return status
        time.sleep(1)
    client.stop_job(job_id)
    raise AssertionError(f"job {job_id} not finished after {timeout_s} s; logs:\n{client.get_job_logs(job_id)}")


def _runtime_env() -> dict:
    """jobs/runtime_env.yaml as `ray job submit --runtime-env` reads it, from the repo root."""
    runtime_env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    runtime_env["working_dir"] = str(REPO / runtime_env["working_dir"])
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **JOB_ENV}
    return runtime_env


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_training_job_succeeds_and_writes_its_summary(head_node, tmp_path):
    client = _client(head_node)
    output = tmp_path / "job-output"
    job_id = client.submit_job(
        entrypoint="python -c 'import raycomp; print(\"raycomp from\", raycomp.__file__)' && "
                   f"python -m jobs.train --config jobs/configs/digits.yaml --output {output} "
                   "--run-id jobs-test workload.epochs=1 workload.steps_per_epoch=12",
        # the repo as working_dir; the pip part of jobs/runtime_env.yaml (a virtualenv per node,
        # slow to build) is the long check below
        runtime_env={"working_dir": str(REPO), "excludes": _runtime_env()["excludes"], "env_vars": JOB_ENV},
    )
    status = _wait(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs
    assert f"output: {output}" in logs  # the job says where its outputs are
    summary = json.loads((output / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["run_id"] == "jobs-test"
    assert summary["steps"] == 12 and summary["world_size"] == 2
    assert summary["final_eval_accuracy"] > 0.1
    assert (output / "plot.png").stat().st_size > 10_000
    assert list(output.glob("checkpoint_*")), "no checkpoint in the output directory"
    # the code came from the uploaded working_dir, not from this checkout
    origin = [line for line in logs.splitlines() if line.startswith("raycomp from ")]
    assert origin and "/runtime_resources/working_dir_files/" in origin[0], origin


def test_bad_config_job_fails_with_the_validation_message(head_node):
    client = _client(head_node)
    job_id = client.submit_job(
        entrypoint="python -m jobs.train --config jobs/configs/digits.yaml compression.policy=magic",
        runtime_env={"working_dir": str(REPO), "env_vars": JOB_ENV},
    )
    assert _wait(client, job_id, timeout_s=180) == "FAILED"
    logs = client.get_job_logs(job_id)
    assert "compression.policy: must be one of" in logs, logs
    assert "exit code 2" in (client.get_job_info(job_id).message or ""), client.get_job_info(job_id)


@pytest.mark.long  # a virtualenv with pip installs on the node: scripts/long-checks.sh
def test_the_documented_runtime_env_installs_what_raycomp_needs_on_the_node(head_node):
    client = _client(head_node)
    job_id = client.submit_job(
        entrypoint="python -c 'import sys, raycomp, pydantic, sklearn, matplotlib, prometheus_client; "
                   "print(\"venv\", sys.prefix, \"raycomp from\", raycomp.__file__)'",
        runtime_env=_runtime_env())  # jobs/runtime_env.yaml, as `ray job submit --runtime-env` reads it
    status = _wait(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs
    line = next(line for line in logs.splitlines() if line.startswith("venv "))
    assert "/runtime_resources/pip/" in line and "/runtime_resources/working_dir_files/" in line, line
