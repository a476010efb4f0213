"""``python -m jobs.bench.netns [--rate 50mbit] [--latency 0] [--seconds 2]``: build a link,
measure its throughput in both directions and its round-trip time, tear it down, print JSON.

``--nodes K``: a switched network of K nodes instead (:mod:`jobs.bench.netns.switch`): each
node's flow to the next, then all nodes but the last sending into the last at once (they
share its link), and a node to its own address (loopback)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jobs.bench.netns.link import ThrottledLink
from jobs.bench.netns.switch import SwitchedNetwork

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status is 1 when anything of the link is left behind."""
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.netns", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="50mbit")
    parser.add_argument("--latency", default="0")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--nodes", type=int, default=0, help="K >= 2: a switched network of K nodes")
    args = parser.parse_args(argv)
    if args.nodes:
        return _switched(args)
    with ThrottledLink(args.rate, args.latency) as link:
        report = {"shaping": link.shaping(),
                  "a_to_b": link.measure_throughput(args.seconds, "a"),
                  "b_to_a": link.measure_throughput(args.seconds, "b"),
                  "rtt": link.measure_rtt()}
    report["leftovers"] = link.leftovers()
    print(json.dumps(report, indent=2))
    return 0 if not report["leftovers"] else 1


def _switched(args: argparse.Namespace) -> int:
    k = args.nodes
    with SwitchedNetwork(k, args.rate) as net:
        report = {"shaping": net.shaping(),
                  "next_node": {f"{i}->{(i + 1) % k}": net.measure_throughput(i, (i + 1) % k, args.seconds)
                                for i in range(k)},
                  "into_last": net.measure_flows([(i, k - 1) for i in range(k - 1)], args.seconds),
                  "loopback": net.measure_throughput(0, 0, min(args.seconds, 1.0))}
    report["leftovers"] = net.leftovers()
    print(json.dumps(report, indent=2))
    return 0 if not report["leftovers"] else 1


if __name__ == "__main__":
    sys.exit(main())
