"""``raycomp.train`` on the switched testbed: K Ray nodes with L workers each
(:func:`jobs.bench.cluster.ray_nodes` over a :class:`~jobs.bench.netns.switch.SwitchedNetwork`),
gloo bound to each node's veth. A short run (tests/support/switch_train.py: dense, then Top-K
over the all-gather, then int8 over the scalable route: all-to-all, reduce, requantize,
all-gather) at W = 4 as 2 nodes x 2 workers, W = 3 as 3 x 1, and W = 8 as 2 x 4 and 8 x 1
ends with bit-identical replicas on every rank, and every rank applied the same plan at every
step. The other transports, local steps and a killed worker's resume: tests/test_switch_modes.py.

Long checks (scripts/long-checks.sh): each starts K Ray nodes and a Ray Train fit; their
times are in docs/testing.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from jobs.bench.cluster import REPO, driver_env, ray_nodes
from jobs.bench.netns.switch import SwitchedNetwork
from tests.support.netns import assert_switch_gone, needs_netns
from tests.support.step_logs import step_logs


@needs_netns
@pytest.mark.long
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 1), (2, 4), (8, 1)], ids=["2x2", "3x1", "2x4", "8x1"])
def test_replicas_stay_bit_identical_and_plans_agree_across_nodes(tmp_path: Path, nodes: int, per_node: int) -> None:
    workers = nodes * per_node
    output = tmp_path / "run"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"output": str(output), "nodes": nodes, "workers": workers,
                                "name": f"switch-{nodes}x{per_node}-{tmp_path.name}"[:60]}))
    net = SwitchedNetwork(nodes, "100mbit")
    started = time.monotonic()
    with net, ray_nodes(net, tmp_path, cpus=per_node) as address:
        up = time.monotonic()
        node_of_inode = {os.stat(f"/run/netns/{ns}").st_ino: i for i, ns in net.ns.items()}
        before = {i: net.counters(i)["tx_bytes"] for i in range(nodes)}
        with open(tmp_path / "driver.log", "w") as log:
            driver = net.popen(0, [sys.executable, "-m", "tests.support.switch_train", str(spec)],
                               env=driver_env(net, address), stdout=log, stderr=log, cwd=REPO)
            code = driver.wait(timeout=600)
        sent = {i: net.counters(i)["tx_bytes"] - before[i] for i in range(nodes)}
    assert_switch_gone(net)
    print(json.dumps({"cluster_up_s": round(up - started, 1), "total_s": round(time.monotonic() - started, 1),
                      "veth_tx_bytes_during_fit": sent}))
    log_tail = (tmp_path / "driver.log").read_text(errors="replace")[-4000:]
    assert code == 0, log_tail
    report = json.loads((output / "driver.json").read_text())
    assert report["status"] == "succeeded", (report, log_tail)
    print(json.dumps({"fit_s": round(report["fit_seconds"], 1)}))

    ranks = [json.loads((output / f"rank{r}.json").read_text()) for r in range(workers)]
    # the ranks are spread as asked: per_node in each node's namespace, Ray agreeing on the
    # node's address, gloo bound to that node's veth
    node = [node_of_inode.get(r["netns_inode"]) for r in ranks]
    assert Counter(node) == dict.fromkeys(range(nodes), per_node), ranks
    assert [r["node_ip"] for r in ranks] == [net.addr[i] for i in node], ranks
    assert [r["gloo_socket_ifname"] for r in ranks] == [net.dev[i] for i in node], ranks
    # bit-identical replicas: parameters and optimizer state, after training moved them
    assert len({r["params"] for r in ranks}) == 1, ranks
    assert len({r["optimizer"] for r in ranks}) == 1, ranks
    assert ranks[0]["params"] != ranks[0]["params_before"]
    assert all(r["world_size"] == workers for r in ranks)

    # every rank applied the same plan at the same step, and the plans did change
    logs = step_logs(output)
    assert len(logs) == workers
    steps = ranks[0]["steps"]
    assert steps == 20
    keys = ("step", "plan_version", "plan_digest", "dense", "applied")
    for r, records in enumerate(logs):
        assert [rec["step"] for rec in records] == list(range(steps)), r
        assert [tuple(rec[k] for k in keys) for rec in records] == [tuple(rec[k] for k in keys) for rec in logs[0]], r
    assert len({rec["plan_digest"] for rec in logs[0]}) >= 3  # dense, Top-K, int8
    assert sum(not rec["dense"] for rec in logs[0]) >= 10
    assert all(rec["applied"] for rec in logs[0])
    totals = report["totals"]
    assert totals["final_plan"]["default"] == {"name": "int8"}
    assert totals["wire_bytes_total"] < totals["dense_bytes_total"]
    # the gradients crossed the switch: every node's link carried traffic during the fit
    assert all(b > 50_000 for b in sent.values()), sent
