"""The throttled two-namespace link of the e2e benchmark (``jobs/bench/netns/``), and the
pure analysis helpers of ``jobs/bench/e2e/``.

Link tests need root and iproute2 (CI runs as root); they are skipped elsewhere. Each one
checks that tear-down leaves no namespace, device or process behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from jobs.bench.netns import (
    NetnsError,
    ThrottledLink,
    namespaces,
    parse_latency,
    parse_rate,
    rate_label,
)
from tests.support.netns import TOLERANCE, alive, links, needs_netns
from tests.support.repo import REPO

RATE = "50mbit"


def _assert_gone(link: ThrottledLink, pids: list[int] = ()) -> None:
    assert link.leftovers() == []
    assert not set(link.ns.values()) & set(namespaces())
    listing = links()
    for dev in link.dev.values():
        assert dev not in listing
    for pid in pids:
        assert not alive(pid), f"process {pid} survived the tear-down"


def _pids_soon(link: ThrottledLink, side: str) -> list[int]:
    """Processes in the namespace, once `ip netns exec` has entered it (it takes a moment)."""
    deadline = time.monotonic() + 10
    while not (pids := link.pids(side)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


# --- pure helpers --------------------------------------------------------------------------
def test_units() -> None:
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("500kbit") == 5e5
    assert parse_rate("10mbps") == 8e7
    assert parse_latency("1ms") == pytest.approx(1e-3)
    assert parse_latency("500us") == pytest.approx(5e-4)
    assert parse_latency("0") == 0
    assert parse_rate("fast") is None and parse_rate(None) is None and rate_label(None) == "fast"
    assert rate_label(1e8) == "100mbit" and rate_label(1e9) == "1gbit" and rate_label(5e5) == "500kbit"
    for bad in ("slow", "-1mbit", "0"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_names_are_unique_and_short() -> None:
    a, b = ThrottledLink(RATE), ThrottledLink(RATE)
    assert a.ns != b.ns and a.dev != b.dev
    for link in (a, b):
        assert all(len(dev) <= 15 for dev in link.dev.values())  # IFNAMSIZ
        assert link.addr["a"].startswith("10.77.") and link.addr["a"].endswith(".1")
        assert link.addr["b"].rsplit(".", 1)[0] == link.addr["a"].rsplit(".", 1)[0]


def test_torch_hook_bytes_model() -> None:
    from jobs.bench.e2e.traces import torch_hook_bytes

    layers = {"w1": [512, 64], "b1": [512], "w2": [10, 512], "b2": [10]}
    numel = 512 * 64 + 512 + 10 * 512 + 10
    assert torch_hook_bytes("allreduce", layers, 2, 3) == [4 * numel] * 3  # 2(W-1)/W = 1 at W=2
    assert torch_hook_bytes("fp16", layers, 4, 1) == [1.5 * 2 * numel]
    # the casts all-reduce fp32 during the shared dense warm-up
    assert torch_hook_bytes("bf16", layers, 2, 3, start_iter=2) == [4 * numel, 4 * numel, 2 * numel]
    steps = torch_hook_bytes("powersgd", layers, 2, 4, rank=2, start_iter=2)
    assert steps[:2] == [4 * numel] * 2
    # w1, w2 compressed to (n + m) x 2; the biases go uncompressed
    assert steps[2] == 4 * ((512 + 64) * 2 + (10 + 512) * 2 + 512 + 10)


# --- the link ------------------------------------------------------------------------------
@needs_netns
@pytest.mark.slow
def test_setup_throttle_and_teardown() -> None:
    link = ThrottledLink(RATE, latency="0")
    with link:
        assert set(link.ns.values()) <= set(namespaces())
        for side in ("a", "b"):
            out = subprocess.run(["ip", "-n", link.ns[side], "-j", "addr", "show", "dev", link.dev[side]],
                                 capture_output=True, text=True, check=True).stdout
            addrs = [a["local"] for a in json.loads(out)[0]["addr_info"]]
            assert link.addr[side] in addrs
            kinds = {q["kind"] for q in link.qdisc_stats(side)}
            assert "tbf" in kinds
        # nothing of ours in the root namespace
        assert not any(dev in links() for dev in link.dev.values())
        # the throttle holds, each way
        measured = link.measure_throughput(2.0, "a")
        assert measured["bits_per_s"] == pytest.approx(parse_rate(RATE), rel=TOLERANCE)
        back = link.measure_throughput(1.0, "b")
        assert back["bits_per_s"] == pytest.approx(parse_rate(RATE), rel=TOLERANCE)
        # and the veth counters saw the bytes
        counters = link.counters("a")
        assert counters["tx_bytes"] >= measured["bytes"]
        link.popen("b", ["sleep", "600"])
        pids = _pids_soon(link, "b")
        assert pids  # `ip netns exec` execs into sleep: it lives inside namespace b
    _assert_gone(link, pids)


@needs_netns
def test_teardown_on_error_and_close_is_idempotent() -> None:
    link = ThrottledLink(RATE)
    with pytest.raises(RuntimeError, match="boom"), link:
        link.popen("a", ["sleep", "600"])
        pids = _pids_soon(link, "a")
        assert pids
        raise RuntimeError("boom")
    _assert_gone(link, pids)
    link.close()
    with pytest.raises(NetnsError):
        link.popen("a", ["true"])


@needs_netns
def test_fast_link_is_an_unshaped_veth() -> None:
    link = ThrottledLink("fast")
    with link:
        assert link.rate_bps is None
        for side in ("a", "b"):
            assert "tbf" not in {q["kind"] for q in link.qdisc_stats(side)}
        shaping = link.shaping()
        assert shaping["rate"] == "fast" and shaping["qdisc"]["a"].startswith("none")
        assert link.measure_throughput(0.5, "a")["bits_per_s"] > 2 * parse_rate("100mbit")
    _assert_gone(link)


def _connects(link: ThrottledLink, timeout_s: float) -> str:
    """What a TCP connect from a to b (a closed port: answered by a reset) says."""
    code = (f"import socket; s = socket.socket(); s.settimeout({timeout_s})\n"
            f"try:\n    s.connect(({link.addr_b!r}, 9))\nexcept OSError as e:\n    print(type(e).__name__)")
    return link.run("a", [sys.executable, "-c", code], timeout=timeout_s + 20).stdout.strip()


@needs_netns
@pytest.mark.parametrize("rate", ["50mbit", "fast"])
def test_a_blackout_drops_every_frame_both_ways_and_restores_the_shaping(rate: str) -> None:
    with ThrottledLink(rate) as link:
        before = {side: link.qdisc_stats(side) for side in ("a", "b")}
        assert _connects(link, 2.0) == "ConnectionRefusedError"  # the link carries the reset
        link.blackout(True)
        assert _connects(link, 1.0) == "TimeoutError"  # nothing crosses, nothing comes back
        dropped = {side: sum(q.get("drops", 0) for q in link.qdisc_stats(side)) for side in ("a", "b")}
        assert dropped["a"] >= 1  # the SYN and its retransmissions died at a's qdisc
        link.blackout(False)
        assert _connects(link, 2.0) == "ConnectionRefusedError"
        assert [[q["kind"] for q in link.qdisc_stats(side)] for side in ("a", "b")] == \
            [[q["kind"] for q in before[side]] for side in ("a", "b")]
        if rate != "fast":  # the throttle is back, not just some link
            measured = link.measure_throughput(1.0, "a")
            assert measured["bits_per_s"] == pytest.approx(parse_rate(rate), rel=TOLERANCE)
    _assert_gone(link)


_CHILD = """
import sys, time
from jobs.bench.netns import ThrottledLink
link = ThrottledLink("50mbit")
with link:
    link.popen("b", ["sleep", "600"])
    deadline = time.monotonic() + 10
    while not link.pids("b") and time.monotonic() < deadline:
        time.sleep(0.05)
    print(" ".join([*link.ns.values(), *link.dev.values(), *map(str, link.pids("b"))]), flush=True)
    time.sleep(600)
"""


@needs_netns
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_on_signal(sig: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=REPO)
    try:
        line = child.stdout.readline().split()
        assert len(line) >= 5, child.stderr.read()
        ns, devs, pids = line[:2], line[2:4], [int(p) for p in line[4:]]
        assert set(ns) <= set(namespaces())
        child.send_signal(sig)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(ns) & set(namespaces()):
        time.sleep(0.1)
    assert not set(ns) & set(namespaces())
    assert not any(dev in links() for dev in devs)
    assert not any(alive(p) for p in pids)


def test_rate_units_match_tc() -> None:
    # tc: "mbit" = 10^6 bit/s; 100 Mbit/s of frames carry 100e6 * 1448 / 1514 bit/s of TCP payload
    assert math.isclose(parse_rate("100mbit") * 1448 / 1514 / 8, 11.96e6, rel_tol=1e-3)
