"""Two Linux network namespaces joined by a throttled veth pair, as a context manager.

    with ThrottledLink(rate="100mbit", latency="1ms") as link:
        link.popen("a", ["python", "server.py", link.addr_a])   # runs inside namespace a
        print(link.counters("a"))                                # veth byte counters

What it builds (root required; ``iproute2``):

* namespaces ``rcbench-<sfx>-a`` and ``rcbench-<sfx>-b`` (``<sfx>`` = 6 random hex digits,
  so parallel runs never collide), ``lo`` up in both;
* a veth pair ``rcb<sfx>a`` (in a) / ``rcb<sfx>b`` (in b), created directly inside the
  namespaces (no interface of the root namespace is ever created or touched), addressed
  ``10.77.<x>.1/24`` and ``10.77.<x>.2/24`` with ``x`` taken from the suffix;
* egress shaping on *both* veth ends, so each direction is limited to ``rate`` (``rate=None``
  or ``"fast"``: no shaping at all, an unshaped veth — the "fast link" of the benchmarks):
  ``netem delay <latency>`` as root qdisc with a ``tbf rate <rate>`` child when the kernel
  has ``sch_netem``; otherwise ``tbf`` alone and :attr:`ThrottledLink.latency_applied` is
  False (the added latency is then recorded as not emulated — see :meth:`shaping`).

Tear-down (:meth:`ThrottledLink.close`, idempotent) kills every process started through
:meth:`ThrottledLink.popen` (its whole process group), then every process still inside
either namespace (``ip netns pids``: only processes we started can be there), then deletes
both namespaces, which deletes the veth pair. It runs on leaving the ``with`` block — also
on an exception or Ctrl-C — from an ``atexit`` hook, and on SIGTERM/SIGHUP (turned into
``SystemExit`` so the ``with`` block unwinds normally).

``python -m jobs.netns [--rate 50mbit] [--latency 0] [--seconds 2]`` builds a link, measures
its throughput in both directions and its round-trip time, and tears it down.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

NS_PREFIX = "rcbench-"
DEV_PREFIX = "rcb"
SUBNET = "10.77"

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)?\s*$", re.I)
_RATE_UNITS = {  # tc's units: "bit" suffixes are bits/s, "bps" suffixes bytes/s; k = 1000
    None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|usec|msec|sec)?\s*$", re.I)
_TIME_UNITS = {None: 1e-3, "s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


class NetnsError(RuntimeError):
    """Setting up the namespaces failed (the partial set-up has been torn down)."""


FAST = "fast"  # an unshaped veth


def parse_rate(text: str | float | None) -> float | None:
    """``"100mbit"`` -> 1e8 (bits per second); tc's units, k/m/g = powers of 1000.

    ``None`` or ``"fast"``: no shaping (returns None).
    """
    if text is None or (isinstance(text, str) and text.strip().lower() == FAST):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    match = _RATE_RE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"invalid rate {text!r}: expected e.g. 100mbit, 1gbit, 500kbit")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _RATE_UNITS[unit]


def parse_latency(text: str | float) -> float:
    """``"1ms"`` -> 0.001 (seconds); a bare number is milliseconds, ``0`` means none."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _TIME_RE.match(text)
    if not match:
        raise ValueError(f"invalid latency {text!r}: expected e.g. 1ms, 500us, 0")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _TIME_UNITS[unit]


def rate_label(bits_per_s: float | None) -> str:
    """1e8 -> ``"100mbit"`` (for file names); None (unshaped) -> ``"fast"``."""
    if bits_per_s is None:
        return FAST
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= factor and (bits_per_s / factor).is_integer():
            return f"{int(bits_per_s / factor)}{unit}"
    return f"{bits_per_s:g}bit"


def _ip() -> str:
    return shutil.which("ip") or "/usr/sbin/ip"


def _tc() -> str:
    return shutil.which("tc") or "/usr/sbin/tc"


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now (``ip netns list``)."""
    out = _run([_ip(), "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netem_available(ns: str, dev: str) -> bool:
    """Whether the kernel has ``sch_netem`` (tried on our own device, then removed)."""
    ok = _run([_tc(), "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem",
               "delay", "1ms"], check=False).returncode == 0
    if ok:
        _run([_tc(), "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return ok


_LIVE: weakref.WeakSet[ThrottledLink] = weakref.WeakSet()
_HANDLERS_LOCK = threading.Lock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}


def _close_all() -> None:
    for link in list(_LIVE):
        link.close()


def _on_signal(signum: int, frame: Any) -> None:
    # unwind through the `with` blocks (their __exit__ tears down); atexit is the backstop
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    with _HANDLERS_LOCK:
        if _PREVIOUS_HANDLERS or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)
            if previous in (signal.SIG_DFL, None):  # leave a caller's own handler alone
                _PREVIOUS_HANDLERS[sig] = previous
                signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    with _HANDLERS_LOCK:
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in _PREVIOUS_HANDLERS.items():
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
        _PREVIOUS_HANDLERS.clear()


atexit.register(_close_all)


class ThrottledLink:
    """Namespaces ``a`` and ``b`` joined by a veth pair shaped to ``rate`` each way."""

    def __init__(self, rate: str | float | None = "100mbit", latency: str | float = "0",
                 suffix: str | None = None, mtu: int = 1500) -> None:
        self.rate_bps = parse_rate(rate)
        self.latency_s = parse_latency(latency)
        self.suffix = suffix or secrets.token_hex(3)
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.suffix):
            raise ValueError(f"suffix {self.suffix!r}: 1-8 lowercase letters/digits")
        self.ns = {"a": f"{NS_PREFIX}{self.suffix}-a", "b": f"{NS_PREFIX}{self.suffix}-b"}
        self.dev = {"a": f"{DEV_PREFIX}{self.suffix}a", "b": f"{DEV_PREFIX}{self.suffix}b"}
        octet = int.from_bytes(self.suffix.encode(), "big") % 250 + 1
        self.subnet = f"{SUBNET}.{octet}.0/24"
        self.addr = {"a": f"{SUBNET}.{octet}.1", "b": f"{SUBNET}.{octet}.2"}
        self.mtu = mtu
        self.latency_applied = False
        self.qdisc: dict[str, str] = {}
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
        _LIVE.add(self)
        _install_handlers()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        ip = _ip()
        for side in ("a", "b"):
            if self.ns[side] in namespaces():
                raise NetnsError(f"namespace {self.ns[side]} already exists")
        for side in ("a", "b"):
            _run([ip, "netns", "add", self.ns[side]])
            self._created.append(self.ns[side])
        # the pair is born inside namespace a, its peer inside b: the root namespace never sees it
        _run([ip, "-n", self.ns_a, "link", "add", self.dev["a"], "mtu", str(self.mtu), "type", "veth",
              "peer", "name", self.dev["b"], "mtu", str(self.mtu), "netns", self.ns_b])
        for side in ("a", "b"):
            ns, dev = self.ns[side], self.dev[side]
            _run([ip, "-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev])
            _run([ip, "-n", ns, "link", "set", "lo", "up"])
            _run([ip, "-n", ns, "link", "set", dev, "up"])
        for side in ("a", "b"):
            self.qdisc[side] = self._shape(side)

    def _shape(self, side: str) -> str:
        """Egress shaping of one veth end; returns the qdisc description."""
        tc, ns, dev = _tc(), self.ns[side], self.dev[side]
        if self.rate_bps is None:
            return "none (unshaped veth)"
        rate_bytes = self.rate_bps / 8
        # burst: >= 1 ms at the rate and a few full frames (the timer granularity); queue:
        # 100 ms at the rate (no drops in normal use, a TCP flow just queues up)
        burst = int(max(4 * (self.mtu + 14), rate_bytes * 1e-3))
        limit = int(max(burst + 64 * 1024, rate_bytes * 0.1))
        tbf = ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "limit", str(limit)]
        if self.latency_s > 0 and netem_available(ns, dev):
            delay = f"{self.latency_s * 1e6:.0f}us"
            _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", delay, "limit", "100000"])
            _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
            self.latency_applied = True
            return f"netem delay {delay} -> {' '.join(tbf)}"
        _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        return " ".join(tbf)

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

    # --- processes inside the namespaces -------------------------------------------------
    def argv(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``side`` (``ip netns exec``)."""
        return [_ip(), "netns", "exec", self.ns[side], *argv]

    def popen(self, side: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside namespace ``side`` in its own process group (tracked)."""
        self._check_open()
        proc = subprocess.Popen(self.argv(side, argv), env=dict(env) if env is not None else None,
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, side: str, argv: Sequence[str], timeout: float = 60, check: bool = True,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` to completion inside namespace ``side``."""
        proc = self.popen(side, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._procs.remove(proc)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} in {self.ns[side]} failed ({proc.returncode}): "
                             f"{err.strip()[-2000:]}")
        return result

    def pids(self, side: str) -> list[int]:
        """Processes inside namespace ``side`` now."""
        out = _run([_ip(), "netns", "pids", self.ns[side]], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def counters(self, side: str) -> dict[str, int]:
        """The veth end's counters: tx/rx bytes and packets, drops (``ip -s link``)."""
        out = _run([_ip(), "-n", self.ns[side], "-j", "-s", "link", "show", "dev", self.dev[side]]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"],
                "tx_dropped": stats["tx"]["dropped"], "rx_dropped": stats["rx"]["dropped"]}

    def qdisc_stats(self, side: str) -> list[dict[str, Any]]:
        out = _run([_tc(), "-n", self.ns[side], "-j", "-s", "qdisc", "show", "dev", self.dev[side]]).stdout
        return json.loads(out or "[]")

    def _check_open(self) -> None:
        if self._closed:
            raise NetnsError("the link has been torn down")

    # --- measurements --------------------------------------------------------------------
    def measure_throughput(self, seconds: float = 2.0, src: str = "a", port: int = 5201) -> dict[str, float]:
        """Bulk TCP from ``src`` to the other side for ``seconds``; receiver-side goodput.

        Returns ``bytes``, ``seconds`` (first to last byte at the receiver), ``bits_per_s``
        (TCP payload) and ``wire_bits_per_s`` (veth bytes of that direction, frames included).
        """
        dst = "b" if src == "a" else "a"
        before = self.counters(src)
        receiver = self.popen(dst, [sys.executable, "-c", _RECEIVER, self.addr[dst], str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = receiver.stdout.readline()  # "ready" once listening
            if line.strip() != "ready":
                raise NetnsError(f"receiver failed: {line}{receiver.stderr.read()}")
            self.run(src, [sys.executable, "-c", _SENDER, self.addr[dst], str(port), str(seconds)],
                     timeout=seconds + 30)
            out, err = receiver.communicate(timeout=30)
        finally:
            self._kill(receiver)
            with contextlib.suppress(ValueError):
                self._procs.remove(receiver)
        after = self.counters(src)
        got = json.loads(out)
        wire = after["tx_bytes"] - before["tx_bytes"]
        return {"bytes": got["bytes"], "seconds": got["seconds"],
                "bits_per_s": 8 * got["bytes"] / got["seconds"],
                "wire_bits_per_s": 8 * wire / got["seconds"],
                "rate_bps": self.rate_bps}

    def measure_rtt(self, count: int = 50, port: int = 5202) -> dict[str, float]:
        """TCP ping-pong of 1-byte messages: median and minimum round trip (seconds)."""
        server = self.popen("b", [sys.executable, "-c", _ECHO, self.addr_b, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise NetnsError(f"echo server failed: {server.stderr.read()}")
            out = self.run("a", [sys.executable, "-c", _PING, self.addr_b, str(port), str(count)]).stdout
        finally:
            self._kill(server)
            with contextlib.suppress(ValueError):
                self._procs.remove(server)
        return json.loads(out)

    # --- tear-down -----------------------------------------------------------------------
    def _kill(self, proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
        for stream in (proc.stdout, proc.stderr, proc.stdin):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()

    def kill_namespace_processes(self, grace: float = 5.0) -> None:
        """SIGTERM then SIGKILL every process inside our namespaces (all started by us)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [p for side in ("a", "b") if self.ns[side] in self._created for p in self.pids(side)]
            pids = [p for p in pids if p != os.getpid()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.05)

    def close(self) -> None:
        """Kill our processes, delete both namespaces (and with them the veth). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                for proc in reversed(self._procs):
                    self._kill(proc)
                self._procs.clear()
                self.kill_namespace_processes()
                for ns in reversed(self._created):
                    _run([_ip(), "netns", "del", ns], check=False)
                # if the pair was somehow created outside (it never is), remove our own name only
                for dev in self.dev.values():
                    if _run([_ip(), "link", "show", "dev", dev], check=False).returncode == 0:
                        _run([_ip(), "link", "del", "dev", dev], check=False)
                self._created.clear()
            finally:
                _LIVE.discard(self)
                _restore_handlers()

    def leftovers(self) -> list[str]:
        """Namespaces or devices of this link that still exist (empty after :meth:`close`)."""
        left = [ns for ns in self.ns.values() if ns in namespaces()]
        left += [dev for dev in self.dev.values()
                 if _run([_ip(), "link", "show", "dev", dev], check=False).returncode == 0]
        return left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def throttled_link(rate: str | float = "100mbit", latency: str | float = "0",
                   suffix: str | None = None) -> Iterator[ThrottledLink]:
    link = ThrottledLink(rate, latency, suffix)
    with link:
        yield link


# --- tiny TCP tools run inside the namespaces ---------------------------------------------
_RECEIVER = textwrap.dedent("""
    import json, socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); c.settimeout(60)
    n, first, last = 0, None, None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        now = time.perf_counter()
        first = now if first is None else first
        last, n = now, n + len(b)
    print(json.dumps({"bytes": n, "seconds": max(1e-9, (last or 0) - (first or 0))}), flush=True)
""")

_SENDER = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    buf, end = b"x" * (64 << 10), time.perf_counter() + float(sys.argv[3])
    while time.perf_counter() < end:
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
""")

_ECHO = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1)
        if not b:
            break
        c.sendall(b)
""")

_PING = textwrap.dedent("""
    import json, socket, statistics, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(sys.argv[3])):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
    c.close()
    print(json.dumps({"median_s": statistics.median(rtts), "min_s": min(rtts), "count": len(rtts)}))
""")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.netns", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="50mbit")
    parser.add_argument("--latency", default="0")
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    with ThrottledLink(args.rate, args.latency) as link:
        report = {"shaping": link.shaping(),
                  "a_to_b": link.measure_throughput(args.seconds, "a"),
                  "b_to_a": link.measure_throughput(args.seconds, "b"),
                  "rtt": link.measure_rtt()}
    report["leftovers"] = link.leftovers()
    print(json.dumps(report, indent=2))
    return 0 if not report["leftovers"] else 1


if __name__ == "__main__":
    sys.exit(main())
