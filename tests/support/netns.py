"""What the tests of the network-namespace testbeds share (``jobs/bench/netns/``): the
skip for a machine that cannot create namespaces, the shaping tolerance, and the checks
that a tear-down left no device or process behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jobs.bench.netns import NS_PREFIX, namespaces

__all__ = ["TOLERANCE", "alive", "assert_switch_gone", "links", "needs_netns"]

#: how far a shaped link's measured throughput may be from its rate (relative)
TOLERANCE = 0.20


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"{NS_PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"cannot create network namespaces: {made.stderr!r}"


needs_netns = pytest.mark.skipif(_netns_usable() is not None, reason=str(_netns_usable()))


def links() -> str:
    """The root namespace's links (``ip -o link``)."""
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_switch_gone(net: Any, pids: list[int] = ()) -> None:
    """A :class:`~jobs.bench.netns.switch.SwitchedNetwork` torn down: no namespace, device or
    process (of ``pids``) left."""
    assert net.leftovers() == []
    assert not {net.switch_ns, *net.ns.values()} & set(namespaces())
    listing = links()
    for dev in (net.bridge, *net.dev.values(), *net.port.values()):
        assert dev not in listing
    for pid in pids:
        assert not alive(pid), f"process {pid} survived the tear-down"
