"""The benchmark's cluster shape: K nodes of L workers (``--topology KxL``).

``2x1`` is the two-namespace veth link (:class:`~jobs.bench.netns.ThrottledLink`) every
earlier report ran on; any other shape is a switch of K namespaces
(:class:`~jobs.bench.netns.switch.SwitchedNetwork`), each node's link to the bridge shaped
both ways, its L workers meeting over the node's own loopback (unshaped, uncounted, as GPUs
of one host). Ray nodes get L CPUs each and the run ``K x L`` workers, one CPU each, so
Ray Train fills every node. The NIC counters the benchmark samples are node 0's link (the
head's; on a ring every node's link carries the same gradient bytes, and node 0's also
carries Ray's control traffic, measured idle and subtracted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jobs.bench.netns import ThrottledLink
from jobs.bench.netns.switch import MAX_NODES, SwitchedNetwork
from jobs.bench.report import eprint

__all__ = ["FLAT", "Topology", "check_switch", "parse_topology"]

FLAT = "2x1"


@dataclass(frozen=True)
class Topology:
    """K nodes of L workers."""

    nodes: int
    per_node: int

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node}"

    @property
    def workers(self) -> int:
        return self.nodes * self.per_node

    def network(self, rate: str | None, latency: str) -> Any:
        """The testbed of this shape (unopened), links shaped to ``rate`` (None: unshaped)."""
        if self.label == FLAT:
            return ThrottledLink(rate, latency)
        if latency not in ("0", "0ms", ""):
            raise ValueError(f"--latency: only the 2x1 link adds delay, got {latency!r} with --topology {self.label}")
        return SwitchedNetwork(self.nodes, rate)

    def describe(self) -> str:
        """How the workers sit, for a report's set-up."""
        if self.label == FLAT:
            return "2 workers (one per Ray node, one thread each)"
        inside = f", the {self.per_node} of a node over its loopback" if self.per_node > 1 else ""
        return (f"{self.workers} workers on {self.nodes} Ray nodes ({self.per_node} per node, one thread each"
                f"{inside}), the nodes joined through a switch")


def parse_topology(text: str) -> Topology:
    """``"KxL"`` (K nodes, L workers per node) -> :class:`Topology`; a clear error otherwise."""
    found = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
    if not found:
        raise ValueError(f"--topology: KxL (nodes x workers per node), e.g. 4x1 or 2x2, got {text!r}")
    nodes, per_node = int(found[1]), int(found[2])
    if not 2 <= nodes <= MAX_NODES or not 1 <= per_node <= 16:
        raise ValueError(f"--topology: 2 to {MAX_NODES} nodes of 1 to 16 workers, got {text!r}")
    return Topology(nodes, per_node)


def check_switch(net: SwitchedNetwork, seconds: float) -> dict[str, Any]:
    """One bulk TCP flow each way between nodes 0 and 1 of the switch, keyed as the two-node
    link's check is (``a_to_b``: node 0 -> 1, ``b_to_a``: back), logged."""
    check = {"a_to_b": net.measure_throughput(0, 1, seconds), "b_to_a": net.measure_throughput(1, 0, seconds)}
    eprint(f"e2e: switch of {net.nodes} nodes, {net.qdisc.get(0)}; node 0 -> 1 "
           f"{check['a_to_b']['bits_per_s'] / 1e6:.1f} Mbit/s, 1 -> 0 {check['b_to_a']['bits_per_s'] / 1e6:.1f} Mbit/s")
    return check
