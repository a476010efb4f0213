"""Ray nodes over a namespace testbed, one per namespace, gloo bound to each node's device.

The benchmarks' two-node cluster: a head in namespace ``a`` and a worker node in ``b`` of a
:class:`~jobs.bench.netns.ThrottledLink`, one CPU each. Each training worker needs one CPU,
so Ray Train places one on each node and every gradient byte crosses the link. The
end-to-end and tune benchmarks run their driver in namespace ``a`` against this cluster.

The same functions take a :class:`~jobs.bench.netns.switch.SwitchedNetwork` of K nodes and
``cpus`` = L CPUs per node: K Ray nodes, the head on node 0, K x L workers. The first key
of the testbed's ``ns`` is the head's node (``"a"``, or ``0``).

Every Ray node (and so every worker it starts) runs with ``GLOO_SOCKET_IFNAME`` = its
namespace's veth, so gloo listens on and advertises that device's address. Two ranks on the
same node therefore connect to the node's own address, which the kernel routes over the
node's loopback (an address of one's own is in the ``local`` table): their traffic never
touches the veth, unshaped and uncounted, as between two GPUs of one host. Only traffic
between nodes crosses the switch.
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

__all__ = ["RAY_ENV", "REPO", "driver_env", "head", "measure_link", "pythonpath", "ray_nodes", "ray_temp",
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


def head(link: Any) -> Any:
    """The key of the testbed's node that holds the Ray head (its first: ``"a"``, or ``0``)."""
    return next(iter(link.ns))


def ray_temp(link: Any) -> dict[Any, Path]:
    """Each node's Ray temporary directory (short: Ray's socket paths have a length limit)."""
    return {side: Path(f"/tmp/rcb-{link.suffix}-{side}") for side in link.ns}


@contextlib.contextmanager
def ray_nodes(link: Any, work: Path, cpus: int = 1) -> Iterator[str]:
    """A Ray node in each of the testbed's namespaces, ``cpus`` CPUs each (the head in the
    first), for the body; yields the GCS address. On the way out the testbed and every node
    are torn down and Ray's logs are kept in ``work/ray-logs-<node>``."""
    temp = ray_temp(link)
    try:
        yield f"{link.addr[head(link)]}:{start_cluster(link, temp, work, cpus=cpus)}"
    finally:
        link.close()
        for side, path in temp.items():  # keep Ray's logs with the run outputs
            logs = path / "session_latest" / "logs"
            if logs.is_dir():
                shutil.copytree(logs, work / f"ray-logs-{side}", dirs_exist_ok=True,
                                ignore_dangling_symlinks=True)
            shutil.rmtree(path, ignore_errors=True)


def driver_env(link: Any, address: str) -> dict[str, str]:
    """The environment of a driver run in the head's namespace against :func:`ray_nodes`' cluster."""
    return {**os.environ, **RAY_ENV, "PYTHONPATH": pythonpath(), "RAY_ADDRESS": address,
            "GLOO_SOCKET_IFNAME": link.dev[head(link)]}


def start_cluster(link: Any, temp: dict[Any, Path], work: Path, port: int = 6379, cpus: int = 1) -> int:
    """``ray start --block`` in every namespace of ``link``, ``cpus`` CPUs each, the head in
    the first; returns the GCS port (at the head's address)."""
    ray = str(Path(sys.executable).with_name("ray"))
    if not Path(ray).exists():
        ray = shutil.which("ray") or "ray"
    first = head(link)
    for side in link.ns:
        shutil.rmtree(temp[side], ignore_errors=True)
    common = ["--block", "--num-cpus", str(cpus), "--disable-usage-stats", "--include-log-monitor=false",
              "--object-store-memory", str(200 * 2**20)]
    gcs = f"{link.addr[first]}:{port}"
    for side in link.ns:  # the head first: the other nodes need its GCS up
        role = (["--head", "--port", str(port), "--include-dashboard=false"] if side == first
                else ["--address", gcs])
        argv = [ray, "start", *role, "--node-ip-address", link.addr[side], "--temp-dir", str(temp[side]), *common]
        env = {**os.environ, **RAY_ENV, "PYTHONPATH": pythonpath(), "GLOO_SOCKET_IFNAME": link.dev[side]}
        env.pop("RAY_ADDRESS", None)
        log_path = work / f"ray-{side}.log"
        with open(log_path, "w") as log:
            proc = link.popen(side, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
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
