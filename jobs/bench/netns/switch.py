"""K namespaces ("nodes") joined through a switch: a Linux bridge in a namespace of its own,
one veth pair per node, each node's link shaped both ways with ``tbf``. See
:mod:`jobs.bench.netns` for what it builds and how it is torn down."""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
from typing import Any

from jobs.bench.netns import cleanup
from jobs.bench.netns.commands import NetnsError, ip, namespaces, run, tbf_args, tc
from jobs.bench.netns.link import DEV_PREFIX, NS_PREFIX, SUBNET
from jobs.bench.netns.namespaced import Namespaced, device_counters
from jobs.bench.netns.units import parse_rate, rate_label

__all__ = ["MAX_NODES", "SwitchedNetwork"]

#: node numbers have at most two digits (device names stay within IFNAMSIZ, 15 characters)
MAX_NODES = 99


class SwitchedNetwork(Namespaced):
    """``nodes`` namespaces, each with one link to a bridge, shaped to ``rate`` each way.

    Node ``i`` (0-based) is namespace ``rcbench-<sfx>-n<i>`` with device ``rcb<sfx>n<i>`` at
    ``addr[i]``; its link's other end is ``rcb<sfx>p<i>``, a port of bridge ``rcb<sfx>br`` in
    namespace ``rcbench-<sfx>-sw``. ``rate=None`` or ``"fast"``: no shaping anywhere.
    """

    def __init__(self, nodes: int = 3, rate: str | float | None = "100mbit", suffix: str | None = None,
                 mtu: int = 1500) -> None:
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes}: 2 to {MAX_NODES}")
        self.nodes = nodes
        self.rate_bps = parse_rate(rate)
        self.suffix = suffix or secrets.token_hex(3)
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.suffix):
            raise ValueError(f"suffix {self.suffix!r}: 1-8 lowercase letters/digits")
        self.ns: dict[Any, str] = {i: f"{NS_PREFIX}{self.suffix}-n{i}" for i in range(nodes)}
        self.switch_ns = f"{NS_PREFIX}{self.suffix}-sw"
        self.dev: dict[Any, str] = {i: f"{DEV_PREFIX}{self.suffix}n{i}" for i in range(nodes)}
        self.port = {i: f"{DEV_PREFIX}{self.suffix}p{i}" for i in range(nodes)}
        self.bridge = f"{DEV_PREFIX}{self.suffix}br"
        octet = int.from_bytes(self.suffix.encode(), "big") % 250 + 1
        self.subnet = f"{SUBNET}.{octet}.0/24"
        self.addr: dict[Any, str] = {i: f"{SUBNET}.{octet}.{i + 1}" for i in range(nodes)}
        self.mtu = mtu
        self.qdisc: dict[int, str] = {}
        self._procs = []
        self._created: list[str] = []
        self._closed = False
        self._lock = threading.Lock()

    # --- set-up --------------------------------------------------------------------------
    def __enter__(self) -> SwitchedNetwork:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> SwitchedNetwork:
        """Build the network (root required); a failed set-up is torn down before it raises."""
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
        all_ns = [self.switch_ns, *self.ns.values()]
        existing = set(namespaces())
        for ns in all_ns:
            if ns in existing:
                raise NetnsError(f"namespace {ns} already exists")
        for ns in all_ns:
            run([ip_, "netns", "add", ns])
            self._created.append(ns)
        sw = self.switch_ns
        run([ip_, "-n", sw, "link", "add", "name", self.bridge, "type", "bridge"])
        run([ip_, "-n", sw, "link", "set", "lo", "up"])
        run([ip_, "-n", sw, "link", "set", self.bridge, "up"])
        for i in range(self.nodes):
            ns, dev, port = self.ns[i], self.dev[i], self.port[i]
            # born inside the node's namespace, its peer inside the switch's: the root
            # namespace never sees either end
            run([ip_, "-n", ns, "link", "add", dev, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", port, "mtu", str(self.mtu), "netns", sw])
            run([ip_, "-n", sw, "link", "set", port, "master", self.bridge])
            run([ip_, "-n", sw, "link", "set", port, "up"])
            run([ip_, "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", dev])
            run([ip_, "-n", ns, "link", "set", "lo", "up"])
            run([ip_, "-n", ns, "link", "set", dev, "up"])
            self.qdisc[i] = self._shape(i)

    def _shape(self, node: int) -> str:
        """Egress shaping of both ends of ``node``'s link (node -> switch on the node's end,
        switch -> node on the bridge port); returns the qdisc description."""
        if self.rate_bps is None:
            return "none (unshaped veth)"
        tbf = tbf_args(self.rate_bps, self.mtu)
        for ns, dev in ((self.ns[node], self.dev[node]), (self.switch_ns, self.port[node])):
            run([tc(), "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        return " ".join(tbf)

    # --- reports -------------------------------------------------------------------------
    def shaping(self) -> dict[str, Any]:
        """What was built (for reports)."""
        return {"topology": "switch", "nodes": self.nodes, "rate_bps": self.rate_bps,
                "rate": rate_label(self.rate_bps), "qdisc": dict(self.qdisc), "mtu": self.mtu,
                "namespaces": dict(self.ns), "switch_namespace": self.switch_ns, "bridge": self.bridge,
                "devices": dict(self.dev), "ports": dict(self.port), "addresses": dict(self.addr),
                "latency_applied": False}

    def port_counters(self, node: int) -> dict[str, int]:
        """Counters of ``node``'s bridge port (its tx is what the switch sent to the node)."""
        return device_counters(self.switch_ns, self.port[node])

    def qdisc_stats(self, node: int, end: str = "node") -> list[dict[str, Any]]:
        """``tc -s qdisc`` of ``node``'s link, on its own end (``"node"``) or the bridge port."""
        ns, dev = (self.ns[node], self.dev[node]) if end == "node" else (self.switch_ns, self.port[node])
        return json.loads(run([tc(), "-n", ns, "-j", "-s", "qdisc", "show", "dev", dev]).stdout or "[]")

    def measure_throughput(self, src: int, dst: int, seconds: float = 2.0, port: int = 5201) -> dict[str, Any]:
        """One bulk TCP flow ``src`` -> ``dst`` for ``seconds``: its goodput
        (:meth:`measure_flows`) and ``wire_bits_per_s``, the bytes ``src``'s device sent meanwhile."""
        before = self.counters(src)
        flow = self.measure_flows([(src, dst)], seconds, port)[0]
        wire = self.counters(src)["tx_bytes"] - before["tx_bytes"]
        return {**flow, "wire_bits_per_s": 8 * wire / flow["seconds"], "rate_bps": self.rate_bps}

    # --- tear-down -----------------------------------------------------------------------
    def close(self) -> None:
        """Kill our processes, delete every namespace (and with them the veths and the
        bridge). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.kill_all()
                for ns in reversed(self._created):
                    run([ip(), "netns", "del", ns], check=False)
                self._created.clear()
            finally:
                cleanup.forget(self)

    def leftovers(self) -> list[str]:
        """Namespaces or devices of this network that still exist (empty after :meth:`close`)."""
        existing = set(namespaces())
        left = [ns for ns in [self.switch_ns, *self.ns.values()] if ns in existing]
        listing = run([ip(), "-o", "link"], check=False).stdout
        left += [dev for dev in [self.bridge, *self.dev.values(), *self.port.values()]
                 if re.search(rf"\b{re.escape(dev)}[@:]", listing)]
        return left
