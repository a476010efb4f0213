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

Many nodes: :class:`~jobs.bench.netns.switch.SwitchedNetwork` (``jobs/bench/netns/switch.py``)::

    with SwitchedNetwork(nodes=4, rate="100mbit") as net:
        net.popen(2, ["python", "server.py", net.addr[2]])   # runs inside node 2
        print(net.counters(2), net.port_counters(2))          # its veth end, its bridge port

* node namespaces ``rcbench-<sfx>-n<i>`` (``i`` = 0 .. K-1), ``lo`` up in each, and a switch
  namespace ``rcbench-<sfx>-sw`` holding a Linux bridge ``rcb<sfx>br``;
* per node one veth pair, created inside the namespaces (never in the root namespace):
  ``rcb<sfx>n<i>`` in the node at ``10.77.<x>.<i+1>/24``, its peer ``rcb<sfx>p<i>`` a port
  of the bridge;
* each node's link shaped both ways with ``tbf`` at ``rate``: egress of the node's end
  (node -> switch) and egress of its bridge port (switch -> node), so a node sends and
  receives at most ``rate`` whoever it talks to, and two senders into one node share its
  rate (unevenly: ``tbf`` is one FIFO queue, as a switch port is), as on a switched Ethernet
  with one link per host. ``"fast"``: no shaping anywhere.
  No added delay (no ``sch_netem`` here). Traffic a node sends to its own address stays on
  its loopback, unshaped and outside the veth counters;
* the same tear-down as the link's (process groups, then every process inside any of the
  namespaces, the switch's included, then the namespaces; on exception, signal and exit),
  through the shared process handling of :mod:`jobs.bench.netns.namespaced`.

``python -m jobs.bench.netns --nodes 4 [--rate 100mbit]`` builds one, measures each node's
flow to the next, all others into the last at once, and a loopback flow, and tears it down.

:mod:`jobs.bench.cluster` starts one Ray node per namespace of either testbed
(``ray_nodes(net, work, cpus=L)``: the head on node 0, L CPUs each) with gloo bound to each
node's veth.
"""

from __future__ import annotations

from jobs.bench.netns.commands import NetnsError, namespaces
from jobs.bench.netns.link import DEV_PREFIX, NS_PREFIX, SUBNET, ThrottledLink, throttled_link
from jobs.bench.netns.switch import SwitchedNetwork
from jobs.bench.netns.units import FAST, parse_latency, parse_rate, rate_label

__all__ = [
    "DEV_PREFIX", "FAST", "NS_PREFIX", "SUBNET", "NetnsError", "SwitchedNetwork", "ThrottledLink", "namespaces",
    "parse_latency", "parse_rate", "rate_label", "throttled_link",
]
