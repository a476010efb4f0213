"""Two Ray nodes over a throttled link: a head in namespace ``a`` and a worker node in ``b``,
one CPU each, joined by :class:`~jobs.bench.netns.ThrottledLink`'s veth pair.

Each training worker needs one CPU, so Ray Train places one on each node and every gradient
byte crosses the link; gloo is bound to each node's veth (``GLOO_SOCKET_IFNAME``). The
end-to-end and tune benchmarks run their driver in namespace ``a`` against this cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs.bench.report import eprint

__all__ = ["RAY_ENV", "REPO", "driver_env", "measure_link", "pythonpath", "ray_nodes", "ray_temp",
           "start_cluster"]

REPO = Path(__file__).resolve().parents[2]

#: the environment of every Ray node and driver of the cluster
RAY_ENV = {
    "RAY_AUTH_MODE": "token",  # Ray >= 2.59 starts clusters with token auth (~/.ray/auth_token)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "180",
    "OMP_NUM_THREADS": "1",
}


def pythonpath() -> str:
    """This checkout first on ``PYTHONPATH``, so the Ray nodes import the code under test."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def measure_link(link: Any, seconds: float, work: Path, label: str = "e2e") -> dict[str, Any]:
    """One bulk TCP flow each way and the round trip over ``link``, logged."""
    eprint(f"{label}: namespaces {link.ns_a} / {link.ns_b}, {link.shaping()['qdisc']['a']}, work {work}")
    check = {"a_to_b": link.measure_throughput(seconds, "a"), "b_to_a": link.measure_throughput(seconds, "b"),
             "rtt": link.measure_rtt(20)}
    eprint(f"{label}: link " + ", ".join(f"{k} {v['bits_per_s'] / 1e6:.1f} Mbit/s"
                                       for k, v in check.items() if "bits_per_s" in v)
           + f", rtt {check['rtt']['median_s'] * 1e6:.0f} us")
    return check


def ray_temp(link: Any) -> dict[str, Path]:
    """Each node's Ray temporary directory (short: Ray's socket paths have a length limit)."""
    return {side: Path(f"/tmp/rcb-{link.suffix}-{side}") for side in ("a", "b")}


@contextlib.contextmanager
def ray_nodes(link: Any, work: Path) -> Iterator[str]:
    """A Ray head (namespace a) and a worker node (b), one CPU each, for the body; yields the
    GCS address. On the way out the link and both nodes are torn down and Ray's logs are kept
    in ``work/ray-logs-{a,b}``."""
    temp = ray_temp(link)
    try:
        yield f"{link.addr_a}:{start_cluster(link, temp, work)}"
    finally:
        link.close()
        for side, path in temp.items():  # keep Ray's logs with the run outputs
            logs = path / "session_latest" / "logs"
            if logs.is_dir():
                shutil.copytree(logs, work / f"ray-logs-{side}", dirs_exist_ok=True,
                                ignore_dangling_symlinks=True)
            shutil.rmtree(path, ignore_errors=True)


def driver_env(link: Any, address: str) -> dict[str, str]:
    """The environment of a driver run in namespace a against :func:`ray_nodes`' cluster."""
    return {**os.environ, **RAY_ENV, "PYTHONPATH": pythonpath(), "RAY_ADDRESS": address,
            "GLOO_SOCKET_IFNAME": link.dev["a"]}


def start_cluster(link: Any, temp: dict[str, Path], work: Path, port: int = 6379) -> int:
    """``ray start --block`` in both namespaces; returns the GCS port (in namespace a)."""
    ray = str(Path(sys.executable).with_name("ray"))
    if not Path(ray).exists():
        ray = shutil.which("ray") or "ray"
    for side in ("a", "b"):
        shutil.rmtree(temp[side], ignore_errors=True)
    common = ["--block", "--num-cpus", "1", "--disable-usage-stats", "--include-log-monitor=false",
              "--object-store-memory", str(200 * 2**20)]
    argv = {
        "a": [ray, "start", "--head", "--node-ip-address", link.addr_a, "--port", str(port),
              "--include-dashboard=false", "--temp-dir", str(temp["a"]), *common],
        "b": [ray, "start", "--address", f"{link.addr_a}:{port}", "--node-ip-address", link.addr_b,
              "--temp-dir", str(temp["b"]), *common],
    }
    for side in ("a", "b"):  # the worker node needs the head's GCS up
        env = {**os.environ, **RAY_ENV, "PYTHONPATH": pythonpath(), "GLOO_SOCKET_IFNAME": link.dev[side]}
        env.pop("RAY_ADDRESS", None)
        log_path = work / f"ray-{side}.log"
        with open(log_path, "w") as log:
            proc = link.popen(side, argv[side], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        _wait_for(log_path, "Ray runtime started", proc, timeout=240)
    return port


def _wait_for(log_path: Path, text: str, proc: subprocess.Popen[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log_path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"ray start did not come up ({log_path}):\n{tail}")
