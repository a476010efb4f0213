"""What every namespace testbed does with the processes it starts: run them inside one of its
namespaces in their own process group, track them, list and kill whatever is inside its
namespaces, and read a device's counters. :class:`~jobs.bench.netns.switch.SwitchedNetwork`
builds on it; a subclass names its namespaces in ``self.ns`` (key -> namespace) and the ones it
created in ``self._created``, and its devices in ``self.dev``/addresses in ``self.addr``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import IO, Any

from jobs.bench.netns import probes
from jobs.bench.netns.commands import NetnsError, alive, ip, run

__all__ = ["Namespaced", "device_counters", "kill_group", "pids_in"]


def kill_group(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace`` seconds; close its pipes."""
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


def pids_in(ns: str) -> list[int]:
    """Processes inside namespace ``ns`` now (``ip netns pids``)."""
    out = run([ip(), "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def device_counters(ns: str, dev: str) -> dict[str, int]:
    """A device's counters inside ``ns``: tx/rx bytes and packets, drops (``ip -s link``)."""
    out = run([ip(), "-n", ns, "-j", "-s", "link", "show", "dev", dev]).stdout
    stats = json.loads(out)[0]["stats64"]
    return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
            "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"],
            "tx_dropped": stats["tx"]["dropped"], "rx_dropped": stats["rx"]["dropped"]}


class Namespaced:
    """Processes inside the testbed's namespaces, and bulk TCP flows between them."""

    ns: dict[Any, str]
    dev: dict[Any, str]
    addr: dict[Any, str]
    _created: list[str]
    _procs: list[subprocess.Popen[Any]]
    _closed: bool

    def argv(self, key: Hashable, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``key`` (``ip netns exec``)."""
        return [ip(), "netns", "exec", self.ns[key], *argv]

    def popen(self, key: Hashable, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdout: int | IO[Any] | None = None,
              stderr: int | IO[Any] | None = None, text: bool = False) -> subprocess.Popen[Any]:
        """Start ``argv`` inside namespace ``key`` in its own process group (tracked: killed
        on tear-down)."""
        self._check_open()
        proc = subprocess.Popen(self.argv(key, argv), env=dict(env) if env is not None else None, cwd=cwd,
                                stdout=stdout, stderr=stderr, text=text, start_new_session=True)
        self._procs.append(proc)
        return proc

    def run(self, key: Hashable, argv: Sequence[str], timeout: float = 60, check: bool = True,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` to completion inside namespace ``key``."""
        proc = self.popen(key, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
        finally:
            self._untrack(proc)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} in {self.ns[key]} failed ({proc.returncode}): "
                             f"{err.strip()[-2000:]}")
        return result

    def pids(self, key: Hashable) -> list[int]:
        """Processes inside namespace ``key`` now."""
        return pids_in(self.ns[key])

    def counters(self, key: Hashable) -> dict[str, int]:
        """Counters of ``key``'s own device (inside its namespace), see :func:`device_counters`."""
        return device_counters(self.ns[key], self.dev[key])

    def _check_open(self) -> None:
        if self._closed:
            raise NetnsError("the testbed has been torn down")

    def _untrack(self, proc: subprocess.Popen[Any]) -> None:
        with contextlib.suppress(ValueError):
            self._procs.remove(proc)

    # --- measurements --------------------------------------------------------------------
    def measure_flows(self, flows: Sequence[tuple[Hashable, Hashable]], seconds: float = 2.0,
                      port: int = 5201) -> list[dict[str, Any]]:
        """Bulk TCP for ``seconds`` along each ``(src, dst)`` of ``flows`` at the same time
        (to ``addr[dst]``, ports ``port``, ``port + 1``, ...); each flow's receiver-side
        goodput: ``bytes``, ``seconds`` (first to last byte) and ``bits_per_s`` (TCP payload)."""
        receivers: list[subprocess.Popen[Any]] = []
        senders: list[subprocess.Popen[Any]] = []
        try:
            for i, (_, dst) in enumerate(flows):
                proc = self.popen(dst, [sys.executable, "-c", probes.RECEIVER, self.addr[dst], str(port + i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                receivers.append(proc)
                if (line := proc.stdout.readline()).strip() != "ready":  # listening
                    raise NetnsError(f"receiver in {self.ns[dst]} failed: {line}{proc.stderr.read()}")
            senders += [self.popen(src, [sys.executable, "-c", probes.SENDER, self.addr[dst], str(port + i),
                                         str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                        for i, (src, dst) in enumerate(flows)]
            for (src, _), proc in zip(flows, senders, strict=True):
                _, err = proc.communicate(timeout=seconds + 30)
                if proc.returncode != 0:
                    raise NetnsError(f"sender in {self.ns[src]} failed: {err.strip()[-2000:]}")
            results = []
            for proc in receivers:
                out, _ = proc.communicate(timeout=30)
                got = json.loads(out)
                results.append({"bytes": got["bytes"], "seconds": got["seconds"],
                                "bits_per_s": 8 * got["bytes"] / got["seconds"]})
            return results
        finally:
            for proc in [*senders, *receivers]:
                kill_group(proc)
                self._untrack(proc)

    # --- tear-down -----------------------------------------------------------------------
    def kill_namespace_processes(self, grace: float = 5.0) -> None:
        """SIGTERM then SIGKILL every process inside the namespaces we created (all started
        by us), those of no key (a switch's) included."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [p for ns in self._created for p in pids_in(ns)]
            pids = [p for p in pids if p != os.getpid()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(alive(p) for p in pids):
                time.sleep(0.05)

    def kill_all(self) -> None:
        """Kill every process started through :meth:`popen` (its group), then whatever else is
        still inside our namespaces."""
        for proc in reversed(self._procs):
            kill_group(proc)
        self._procs.clear()
        self.kill_namespace_processes()
