"""``python -m jobs.bench.netns [--rate 50mbit] [--latency 0] [--seconds 2]``: build a link,
measure its throughput in both directions and its round-trip time, tear it down, print JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jobs.bench.netns.link import ThrottledLink

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status is 1 when anything of the link is left behind."""
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.netns", description=__doc__,
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
