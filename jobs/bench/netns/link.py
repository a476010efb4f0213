"""The throttled link itself: namespaces ``a`` and ``b`` joined by a veth pair, shaped with
``tbf`` (and ``netem`` for delay) on both ends; processes run inside them; tear-down.
See :mod:`jobs.bench.netns` for what it builds and how it is torn down."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from jobs.bench.netns import cleanup, probes
from jobs.bench.netns.commands import NetnsError, ip, namespaces, netem_available, run, tbf_args, tc
from jobs.bench.netns.namespaced import Namespaced, kill_group
from jobs.bench.netns.units import parse_latency, parse_rate, rate_label

__all__ = ["DEV_PREFIX", "NS_PREFIX", "SUBNET", "ThrottledLink", "throttled_link"]

NS_PREFIX = "rcbench-"
DEV_PREFIX = "rcb"
SUBNET = "10.77"


class ThrottledLink(Namespaced):
    """Namespaces ``a`` and ``b`` joined by a veth pair shaped to ``rate`` each way; processes
    inside them (``popen``, ``run``, ``pids``, ``counters``) as :class:`Namespaced` runs them."""

    def __init__(self, rate: str | float | None = "100mbit", latency: str | float = "0",
                 suffix: str | None = None, mtu: int = 1500) -> None:
        self.rate_bps = parse_rate(rate)
        self.latency_s = parse_latency(latency)
        self.suffix = suffix or secrets.token_hex(3)
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.suffix):
            raise ValueError(f"suffix {self.suffix!r}: 1-8 lowercase letters/digits")
        self.ns: dict[Any, str] = {"a": f"{NS_PREFIX}{self.suffix}-a", "b": f"{NS_PREFIX}{self.suffix}-b"}
        self.dev: dict[Any, str] = {"a": f"{DEV_PREFIX}{self.suffix}a", "b": f"{DEV_PREFIX}{self.suffix}b"}
        octet = int.from_bytes(self.suffix.encode(), "big") % 250 + 1
        self.subnet = f"{SUBNET}.{octet}.0/24"
        self.addr: dict[Any, str] = {"a": f"{SUBNET}.{octet}.1", "b": f"{SUBNET}.{octet}.2"}
        self.mtu = mtu
        self.latency_applied = False
        self.qdisc: dict[str, str] = {}
        self._tbf: dict[str, tuple[list[str], list[str]]] = {}  # side -> (where, tbf args) of its shaper
        self.blacked_out = False
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._closed = False
        self._lock = threading.Lock()

    # --- convenience names ---------------------------------------------------------------
    @property
    def ns_a(self) -> str:
        return self.ns["a"]

    @property
    def ns_b(self) -> str:
        return self.ns["b"]

    @property
    def addr_a(self) -> str:
        return self.addr["a"]

    @property
    def addr_b(self) -> str:
        return self.addr["b"]

    # --- set-up --------------------------------------------------------------------------
    def __enter__(self) -> ThrottledLink:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> ThrottledLink:
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root")
        cleanup.register(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        ip_ = ip()
        for side in ("a", "b"):
            if self.ns[side] in namespaces():
                raise NetnsError(f"namespace {self.ns[side]} already exists")
        for side in ("a", "b"):
            run([ip_, "netns", "add", self.ns[side]])
            self._created.append(self.ns[side])
        # the pair is born inside namespace a, its peer inside b: the root namespace never sees it
        run([ip_, "-n", self.ns_a, "link", "add", self.dev["a"], "mtu", str(self.mtu), "type", "veth",
              "peer", "name", self.dev["b"], "mtu", str(self.mtu), "netns", self.ns_b])
        for side in ("a", "b"):
            ns, dev = self.ns[side], self.dev[side]
            run([ip_, "-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev])
            run([ip_, "-n", ns, "link", "set", "lo", "up"])
            run([ip_, "-n", ns, "link", "set", dev, "up"])
        for side in ("a", "b"):
            self.qdisc[side] = self._shape(side)

    def _shape(self, side: str) -> str:
        """Egress shaping of one veth end; returns the qdisc description."""
        tc_, ns, dev = tc(), self.ns[side], self.dev[side]
        if self.rate_bps is None:
            return "none (unshaped veth)"
        tbf = tbf_args(self.rate_bps, self.mtu)
        if self.latency_s > 0 and netem_available(ns, dev):
            delay = f"{self.latency_s * 1e6:.0f}us"
            run([tc_, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", delay, "limit", "100000"])
            run([tc_, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
            self._tbf[side] = (["parent", "1:1", "handle", "10:"], tbf)
            self.latency_applied = True
            return f"netem delay {delay} -> {' '.join(tbf)}"
        run([tc_, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        self._tbf[side] = (["root", "handle", "1:"], tbf)
        return " ".join(tbf)

    # --- faults --------------------------------------------------------------------------
    #: a shaper no frame gets through: a token a second, a bucket smaller than any frame
    BLACKHOLE = ["tbf", "rate", "8bit", "burst", "32", "limit", "32"]

    def blackout(self, on: bool) -> None:
        """Cut the link both ways (``on``) or give it back its shaping. Every frame is dropped
        at the sender's qdisc while the interfaces, addresses and routes stay as they were:
        what a cable pulled somewhere on the path looks like to both hosts (TCP retransmits
        into the void), without taking down the local routes of the nodes' own addresses as
        ``ip link set down`` would (this kernel has no ``sch_netem`` to drop packets with)."""
        self._check_open()
        tc_ = tc()
        for side in ("a", "b"):
            ns, dev = self.ns[side], self.dev[side]
            where, tbf = self._tbf.get(side, (["root", "handle", "1:"], None))
            if tbf is None:  # an unshaped veth: a root qdisc only while cut
                command = ["add", *where, *self.BLACKHOLE] if on else ["del", "root"]
            else:
                command = ["change", *where, *(self.BLACKHOLE if on else tbf)]
            run([tc_, "-n", ns, "qdisc", command[0], "dev", dev, *command[1:]])
        self.blacked_out = on

    def shaping(self) -> dict[str, Any]:
        """What was asked for and what the kernel applied (for reports)."""
        return {
            "rate_bps": self.rate_bps, "rate": rate_label(self.rate_bps),
            "latency_requested_s": self.latency_s,
            "latency_applied": self.latency_applied,
            "qdisc": dict(self.qdisc), "mtu": self.mtu,
            "namespaces": dict(self.ns), "devices": dict(self.dev), "addresses": dict(self.addr),
            "note": None if self.latency_applied or self.latency_s == 0 else
            "the kernel has no sch_netem: one-way delay not emulated (tbf only)",
        }

    def qdisc_stats(self, side: str) -> list[dict[str, Any]]:
        out = run([tc(), "-n", self.ns[side], "-j", "-s", "qdisc", "show", "dev", self.dev[side]]).stdout
        return json.loads(out or "[]")

    # --- measurements --------------------------------------------------------------------
    def measure_throughput(self, seconds: float = 2.0, src: str = "a", port: int = 5201) -> dict[str, float]:
        """Bulk TCP from ``src`` to the other side for ``seconds``; receiver-side goodput.

        Returns ``bytes``, ``seconds`` (first to last byte at the receiver), ``bits_per_s``
        (TCP payload) and ``wire_bits_per_s`` (veth bytes of that direction, frames included).
        """
        dst = "b" if src == "a" else "a"
        before = self.counters(src)
        receiver = self.popen(dst, [sys.executable, "-c", probes.RECEIVER, self.addr[dst], str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = receiver.stdout.readline()  # "ready" once listening
            if line.strip() != "ready":
                raise NetnsError(f"receiver failed: {line}{receiver.stderr.read()}")
            self.run(src, [sys.executable, "-c", probes.SENDER, self.addr[dst], str(port), str(seconds)],
                     timeout=seconds + 30)
            out, err = receiver.communicate(timeout=30)
        finally:
            kill_group(receiver)
            self._untrack(receiver)
        after = self.counters(src)
        got = json.loads(out)
        wire = after["tx_bytes"] - before["tx_bytes"]
        return {"bytes": got["bytes"], "seconds": got["seconds"],
                "bits_per_s": 8 * got["bytes"] / got["seconds"],
                "wire_bits_per_s": 8 * wire / got["seconds"],
                "rate_bps": self.rate_bps}

    def measure_rtt(self, count: int = 50, port: int = 5202) -> dict[str, float]:
        """TCP ping-pong of 1-byte messages: median and minimum round trip (seconds)."""
        server = self.popen("b", [sys.executable, "-c", probes.ECHO, self.addr_b, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise NetnsError(f"echo server failed: {server.stderr.read()}")
            out = self.run("a", [sys.executable, "-c", probes.PING, self.addr_b, str(port), str(count)]).stdout
        finally:
            kill_group(server)
            self._untrack(server)
        return json.loads(out)

    # --- tear-down -----------------------------------------------------------------------
    def close(self) -> None:
        """Kill our processes, delete both namespaces (and with them the veth). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.kill_all()
                for ns in reversed(self._created):
                    run([ip(), "netns", "del", ns], check=False)
                # if the pair was somehow created outside (it never is), remove our own name only
                for dev in self.dev.values():
                    if run([ip(), "link", "show", "dev", dev], check=False).returncode == 0:
                        run([ip(), "link", "del", "dev", dev], check=False)
                self._created.clear()
            finally:
                cleanup.forget(self)

    def leftovers(self) -> list[str]:
        """Namespaces or devices of this link that still exist (empty after :meth:`close`)."""
        left = [ns for ns in self.ns.values() if ns in namespaces()]
        left += [dev for dev in self.dev.values()
                 if run([ip(), "link", "show", "dev", dev], check=False).returncode == 0]
        return left


@contextlib.contextmanager
def throttled_link(rate: str | float = "100mbit", latency: str | float = "0",
                   suffix: str | None = None) -> Iterator[ThrottledLink]:
    """``with throttled_link(...) as link``: a :class:`ThrottledLink`, open for the block."""
    link = ThrottledLink(rate, latency, suffix)
    with link:
        yield link
