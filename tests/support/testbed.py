"""A driver module run on the switched testbed, for the long checks that train on it
(tests/test_switch_modes.py, tests/test_switch_frameworks.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from jobs.bench.cluster import REPO, driver_env, ray_nodes
from jobs.bench.netns.switch import SwitchedNetwork


def drive(work: Path, nodes: int, per_node: int, module: str, spec: dict[str, Any],
          timeout_s: int = 900) -> dict[str, Any]:
    """Start ``nodes`` Ray nodes of ``per_node`` CPUs behind a 100 Mbit/s switch, run
    ``python -m module SPEC`` as the driver in node 0's namespace, tear everything down and
    check it is gone. Returns the driver's ``<spec output>/driver.json`` (asserted
    succeeded) with the testbed's ``net``, ``node_of_inode`` (each node's namespace by
    inode) and the seconds it took (``cluster_up_s``, ``total_s``)."""
    from tests.support.netns import assert_switch_gone

    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    net = SwitchedNetwork(nodes, "100mbit")
    started = time.monotonic()
    with net, ray_nodes(net, work, cpus=per_node) as address:
        up = time.monotonic()
        node_of_inode = {os.stat(f"/run/netns/{ns}").st_ino: i for i, ns in net.ns.items()}
        with open(work / "driver.log", "w") as log:
            driver = net.popen(0, [sys.executable, "-m", module, str(spec_path)],
                               env=driver_env(net, address), stdout=log, stderr=log, cwd=REPO)
            code = driver.wait(timeout=timeout_s)
    assert_switch_gone(net)
    log_tail = (work / "driver.log").read_text(errors="replace")[-4000:]
    assert code == 0, log_tail
    report = json.loads((Path(spec["output"]) / "driver.json").read_text())
    assert report["status"] == "succeeded", (report, log_tail)
    return {**report, "net": net, "node_of_inode": node_of_inode, "cluster_up_s": round(up - started, 1),
            "total_s": round(time.monotonic() - started, 1)}
