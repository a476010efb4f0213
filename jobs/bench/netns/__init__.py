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

``python -m jobs.bench.netns [--rate 50mbit] [--latency 0] [--seconds 2]`` builds a link,
measures its throughput in both directions and its round-trip time, and tears it down.
"""

from __future__ import annotations

from jobs.bench.netns.commands import NetnsError, namespaces
from jobs.bench.netns.link import DEV_PREFIX, NS_PREFIX, SUBNET, ThrottledLink, throttled_link
from jobs.bench.netns.units import FAST, parse_latency, parse_rate, rate_label

__all__ = [
    "DEV_PREFIX", "FAST", "NS_PREFIX", "SUBNET", "NetnsError", "ThrottledLink", "namespaces", "parse_latency",
    "parse_rate", "rate_label", "throttled_link",
]
