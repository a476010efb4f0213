"""The ``ip`` and ``tc`` commands the link is built with, and what they report about the
namespaces that exist now."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["NetnsError", "alive", "ip", "namespaces", "netem_available", "run", "tbf_args", "tc"]


class NetnsError(RuntimeError):
    """Setting up the namespaces failed (the partial set-up has been torn down)."""


def ip() -> str:
    """The ``ip`` binary (iproute2)."""
    return shutil.which("ip") or "/usr/sbin/ip"


def tc() -> str:
    """The ``tc`` binary (iproute2)."""
    return shutil.which("tc") or "/usr/sbin/tc"


def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (30 s at most); with ``check`` a failure raises :class:`NetnsError`."""
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now (``ip netns list``)."""
    out = run([ip(), "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netem_available(ns: str, dev: str) -> bool:
    """Whether the kernel has ``sch_netem`` (tried on our own device, then removed)."""
    ok = run([tc(), "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem",
               "delay", "1ms"], check=False).returncode == 0
    if ok:
        run([tc(), "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return ok


def tbf_args(rate_bps: float, mtu: int) -> list[str]:
    """The ``tc`` arguments of a ``tbf`` limiting egress to ``rate_bps``: a burst of >= 1 ms
    at the rate and a few full frames (the timer granularity), a queue of 100 ms at the rate
    (no drops in normal use, a TCP flow just queues up)."""
    rate_bytes = rate_bps / 8
    burst = int(max(4 * (mtu + 14), rate_bytes * 1e-3))
    limit = int(max(burst + 64 * 1024, rate_bytes * 0.1))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False
