"""Checks of a config against this machine and its cluster, before Ray starts: data,
writable paths, metrics endpoint, sizes, CPUs/GPUs. Each failure is a one-line
:class:`~raycomp.config.ConfigError` naming the key."""

from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from jobs.config.job_sections import JobConfig
from raycomp.config import ConfigError

__all__ = ["DIGITS_TRAIN_EXAMPLES", "check_cluster_fits", "check_controller_paths", "check_metrics_endpoint",
           "check_resources", "check_sizes", "check_writable_dir", "check_writable_file", "local_cpus",
           "train_examples"]


def check_resources(config: JobConfig) -> None:
    """Things outside the config that must exist before any cluster resource is taken."""
    from jobs import data

    fashion_dir = Path(config.workload.data_dir or data.FASHION_MNIST_DIR)
    shipped = config.workload.entrypoint is None  # a user workload checks its own data
    if shipped and config.workload.name == "fashion_mnist":
        if not (fashion_dir / "train-images-idx3-ubyte.gz").is_file():
            raise ConfigError(
                f"workload.data_dir: no Fashion-MNIST in {str(fashion_dir)!r}; install the Debian "
                "package 'dataset-fashion-mnist' or point workload.data_dir at the IDX files"
            )
        for name in data.FASHION_MNIST_FILES:
            try:
                data.idx_header(fashion_dir / name)
            except (OSError, ValueError, EOFError) as error:
                raise ConfigError(f"workload.data_dir: {name} is unreadable: {error}") from None
    if shipped and config.workload.name == "kjv" and shutil.which("bible") is None and not data.kjv_cache_file().is_file():
        raise ConfigError(
            "workload.name: kjv needs the Debian packages 'bible-kjv bible-kjv-text' "
            "(program 'bible' not found)"
        )
    if config.compression.memory == "dgc" and config.workload.momentum > 0:
        raise ConfigError(
            "compression.memory: 'dgc' applies momentum itself; set workload.momentum=0 "
            f"(got {config.workload.momentum})"
        )
    from raycomp._internal.observe.metrics import SD_DIR

    address = os.environ.get("RAY_ADDRESS")
    check_sizes(config)
    check_cluster_fits(config, address)
    check_controller_paths(config, address, SD_DIR)


# --- checks against the machine (before Ray starts) --------------------------------------
#: sklearn's digits: 1,797 images, 20 % held out for evaluation (see jobs.data.digits)
DIGITS_TRAIN_EXAMPLES = 1797 - int(1797 * 0.2)


def local_cpus() -> int:
    """CPUs an embedded ``ray.init()`` would see here (the affinity mask, capped by a cgroup
    v2 CPU quota as Ray does)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def _is_local(address: str | None) -> bool:
    """True when the Ray cluster (and so the controller actor) runs on this machine's files:
    an embedded cluster, or a driver on a cluster node; False for a Ray Client (ray://)."""
    return not (address or "").startswith("ray://")


def check_writable_dir(key: str, value: str | Path, shown: str | Path | None = None) -> Path:
    """``value`` as an absolute directory that exists and is writable, or can be created.

    Nothing is left behind: writability is probed with a temporary directory in the
    directory itself, or in its nearest existing ancestor (where it would be created).
    """
    try:
        path = Path(value).expanduser().resolve()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{key}: {str(path)!r} exists and is not a directory")
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"{key}: cannot create {str(path)!r}: {str(parent)!r} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".raycomp-probe-", dir=parent))
    except ConfigError:
        raise
    except (OSError, ValueError, RuntimeError) as error:
        where = f" in {str(parent)!r}" if "parent" in locals() else ""
        reason = getattr(error, "strerror", None) or str(error)
        what = "is not a writable directory" if shown is None else "cannot be written"
        raise ConfigError(f"{key}: {str(shown or value)!r} {what} (cannot create a "
                          f"directory{where}: {reason})") from None
    return path


def check_writable_file(key: str, value: str | Path) -> Path:
    """``value`` as a file path whose folder is (or can be made) writable."""
    path = Path(value).expanduser()
    if str(value).endswith(("/", os.sep)) or (path.exists() and path.is_dir()):
        raise ConfigError(f"{key}: {str(value)!r} is a directory; expected a file path")
    check_writable_dir(key, path.parent, shown=value)
    return path.resolve()


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def check_metrics_endpoint(host: str, port: int) -> None:
    """On an embedded cluster the controller's exporter binds ``host:port`` on this machine:
    the address must be one of this machine's and the port free (or already serving
    raycomp metrics: the controller is shared by every run)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        raise ConfigError(f"controller.metrics_host: cannot resolve {host!r} ({error})") from None
    family, _, _, _, sockaddr = infos[0]
    address = sockaddr[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, 0, *sockaddr[2:]))
        except OSError as error:
            raise ConfigError(f"controller.metrics_host: cannot listen on {host!r} on this machine "
                              f"({error.strerror}); use 127.0.0.1, 0.0.0.0 or one of its addresses") from None
    if port == 0:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port, *sockaddr[2:]))
            return
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM):
                raise ConfigError(f"controller.metrics_port: {port} needs privileges to listen on "
                                  f"({error.strerror}); use a port >= 1024 (0 picks a free one)") from None
    try:
        import urllib.request

        with urllib.request.urlopen(f"http://{_url_host(address)}:{port}/metrics", timeout=2) as answer:
            if b"raycomp_" in answer.read(1 << 20):
                return  # our own controller's exporter: it is shared by every run
    except (OSError, ValueError):
        pass
    raise ConfigError(f"controller.metrics_port: {port} on {host} is in use by another program; "
                      "choose a free port (0 picks one)")


def train_examples(config: JobConfig) -> int | None:
    """Training examples of a classification workload (None: windows sampled from a corpus)."""
    from jobs import data

    if config.workload.name == "digits":
        return DIGITS_TRAIN_EXAMPLES
    if config.workload.name == "fashion_mnist":
        root = Path(config.workload.data_dir or data.FASHION_MNIST_DIR)
        return data.idx_header(root / "train-labels-idx1-ubyte.gz")[0]
    return None


def check_sizes(config: JobConfig) -> None:
    """Batch and window sizes against the data, so no rank finds an empty epoch."""
    w, workers = config.workload, config.scaling.num_workers
    examples = train_examples(config)
    if examples is not None and w.batch_size * workers > examples:
        raise ConfigError(
            f"workload.batch_size: {w.batch_size} x {workers} workers (scaling.num_workers) exceeds the "
            f"{examples} training examples of {w.name}; at most {examples // workers} per worker")
    if w.name == "kjv" and w.max_chars is not None:
        test_chars = int(w.max_chars * 0.05)  # jobs.data.CharCorpus.from_text holds out 5 %
        if test_chars <= w.block + 1:
            raise ConfigError(
                f"workload.block: {w.block} is too long for the {test_chars}-character test split of "
                f"workload.max_chars={w.max_chars}; use block < {test_chars - 1} or a larger max_chars")


def check_cluster_fits(config: JobConfig, address: str | None) -> None:
    """On an embedded cluster, the workers must fit this machine: Ray Train would otherwise
    wait for CPUs or GPUs that never come. (A running cluster may autoscale: not checked.)"""
    if address:
        return
    s = config.scaling
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # the run will use this process's cluster
        resources = ray.cluster_resources()
        cpus, gpus, where = resources.get("CPU", 0), resources.get("GPU", 0), "the Ray cluster of this process"
    else:
        cpus, gpus, where = local_cpus(), None, "this machine"
    if s.num_workers * s.cpus_per_worker > cpus:
        raise ConfigError(
            f"scaling.num_workers: {s.num_workers} workers x {s.cpus_per_worker:g} CPU each "
            f"(scaling.cpus_per_worker) need {s.num_workers * s.cpus_per_worker:g} CPUs; {where} "
            f"has {cpus:g} (set RAY_ADDRESS to use a cluster)")
    if s.use_gpu:
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        if gpus < s.num_workers:
            raise ConfigError(f"scaling.use_gpu: needs {s.num_workers} GPUs (one per worker, "
                              f"scaling.num_workers); {where} has {gpus:g}")


def check_controller_paths(config: JobConfig, address: str | None, default_sd_dir: str) -> None:
    """Where the controller writes (snapshots, the Prometheus file-SD list) must be writable."""
    if not _is_local(address):
        return
    c = config.controller
    if c.snapshot_dir is not None:
        check_writable_dir("controller.snapshot_dir", c.snapshot_dir)
    if c.metrics_enabled:
        check_writable_file("controller.metrics_sd_file", c.metrics_sd_file or f"{default_sd_dir}/{c.name}.json")
        if not _is_ip(c.metrics_host):
            try:
                socket.getaddrinfo(c.metrics_host, None)
            except (OSError, UnicodeError) as error:
                raise ConfigError(f"controller.metrics_host: cannot resolve {c.metrics_host!r} "
                                  f"({getattr(error, 'strerror', None) or error})") from None


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False
