"""The switched many-node testbed (:class:`jobs.bench.netns.switch.SwitchedNetwork`): K node
namespaces joined through a bridge in its own namespace, each node's link shaped both ways.

Like tests/test_netns.py these need root and iproute2 and are skipped elsewhere; each checks
that tear-down leaves no namespace, device or process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jobs.bench.netns import NetnsError, namespaces, parse_rate
from jobs.bench.netns.switch import SwitchedNetwork
from tests.support.netns import TOLERANCE, alive, assert_switch_gone, links, needs_netns
from tests.support.repo import REPO

RATE = "50mbit"


def _reachable(net: SwitchedNetwork, src: int) -> dict[str, str]:
    """What a TCP connect from node ``src`` to every node's address (a closed port, answered
    by a reset if the SYN arrives) says, by address."""
    code = textwrap.dedent(f"""
        import json, socket
        out = {{}}
        for addr in {list(net.addr.values())!r}:
            s = socket.socket(); s.settimeout(2.0)
            try:
                s.connect((addr, 9)); out[addr] = "connected"
            except OSError as e:
                out[addr] = type(e).__name__
            s.close()
        print(json.dumps(out))
    """)
    return json.loads(net.run(src, [sys.executable, "-c", code], timeout=60).stdout)


def _wait_pids(net: SwitchedNetwork, node: int) -> list[int]:
    import time

    deadline = time.monotonic() + 10
    while not (pids := net.pids(node)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def test_names_are_unique_short_and_per_node() -> None:
    a, b = SwitchedNetwork(4, RATE), SwitchedNetwork(4, RATE)
    assert a.ns != b.ns and a.dev != b.dev and a.switch_ns != b.switch_ns
    for net in (a, b):
        names = [net.bridge, *net.dev.values(), *net.port.values()]
        assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names)  # IFNAMSIZ
        assert len(set(net.addr.values())) == 4
        assert all(ns.endswith(f"-n{i}") for i, ns in net.ns.items()) and net.switch_ns.endswith("-sw")
    longest = SwitchedNetwork(99, RATE, suffix="abcdefgh")
    assert max(len(n) for n in [longest.bridge, *longest.dev.values(), *longest.port.values()]) <= 15
    for bad in (1, 100):
        with pytest.raises(ValueError):
            SwitchedNetwork(bad)


@needs_netns
@pytest.mark.slow
@pytest.mark.parametrize("nodes", [3, 4])
def test_every_node_reaches_every_other_through_its_own_shaped_link(nodes: int) -> None:
    rate = parse_rate(RATE)
    with SwitchedNetwork(nodes, RATE) as net:
        assert {net.switch_ns, *net.ns.values()} <= set(namespaces())
        listing = links()  # nothing of ours in the root namespace
        assert not any(dev in listing for dev in (net.bridge, *net.dev.values(), *net.port.values()))
        for i in range(nodes):
            # shaped on both ends of the node's link
            assert [q["kind"] for q in net.qdisc_stats(i, "node")] == ["tbf"]
            assert [q["kind"] for q in net.qdisc_stats(i, "port")] == ["tbf"]
            assert set(_reachable(net, i).values()) == {"ConnectionRefusedError"}, i
        # each node's link carries its rate, up and down (node i -> node i+1): never more
        # than its shaping lets through, and at least half of it (a CPU shared with other
        # work slows the sending process, not the link: 74% was seen under load)
        for i in range(nodes):
            measured = net.measure_throughput(i, (i + 1) % nodes, 1.0)
            for key in ("bits_per_s", "wire_bits_per_s"):
                assert rate / 2 <= measured[key] <= rate * (1 + TOLERANCE), (i, key, measured)
        # the switch -> node direction is shaped too: two senders into one node share its rate
        # (with the bridge port unshaped they would get their two uplinks' worth)
        flows = net.measure_flows([(0, nodes - 1), (1, nodes - 1)], 1.5)
        total = sum(f["bits_per_s"] for f in flows)
        assert total == pytest.approx(rate, rel=TOLERANCE), flows
        # the bridge port's counters saw what the node received
        assert net.port_counters(nodes - 1)["tx_bytes"] >= sum(f["bytes"] for f in flows)
        # a node talking to its own address stays on its (unshaped) loopback: no veth byte
        before = net.counters(0)["tx_bytes"]
        local = net.measure_throughput(0, 0, 0.5)
        assert local["bits_per_s"] > 4 * rate
        assert net.counters(0)["tx_bytes"] - before < 100_000  # a few stray frames at most
    assert_switch_gone(net)


@needs_netns
def test_fast_links_are_unshaped_veths() -> None:
    with SwitchedNetwork(3, "fast") as net:
        assert net.rate_bps is None and net.shaping()["rate"] == "fast"
        for i in range(3):
            for end in ("node", "port"):
                assert "tbf" not in {q["kind"] for q in net.qdisc_stats(i, end)}
        assert set(_reachable(net, 2).values()) == {"ConnectionRefusedError"}
        assert net.measure_throughput(0, 2, 0.5)["bits_per_s"] > 2 * parse_rate("100mbit")
    assert_switch_gone(net)


@needs_netns
def test_teardown_on_error_kills_every_node_process_and_close_is_idempotent() -> None:
    net = SwitchedNetwork(3, RATE)
    pids = []
    with pytest.raises(RuntimeError, match="boom"), net:
        for i in range(3):
            net.popen(i, ["sleep", "600"])
            pids += _wait_pids(net, i)
        assert len(pids) == 3
        raise RuntimeError("boom")
    assert_switch_gone(net, pids)
    net.close()
    with pytest.raises(NetnsError):
        net.popen(0, ["true"])


@needs_netns
def test_a_failed_setup_leaves_nothing_behind() -> None:
    net = SwitchedNetwork(3, RATE)
    taken = net.ns[2]
    subprocess.run(["ip", "netns", "add", taken], check=True)  # a namespace of that name already exists
    try:
        with pytest.raises(NetnsError, match="already exists"):
            net.open()
        assert net.leftovers() == [taken]  # only the one we did not create
    finally:
        subprocess.run(["ip", "netns", "del", taken], check=False)
    assert_switch_gone(net)


_CHILD = """
import time
from jobs.bench.netns.switch import SwitchedNetwork
net = SwitchedNetwork(3, "50mbit")
with net:
    net.popen(1, ["sleep", "600"])
    deadline = time.monotonic() + 10
    while not net.pids(1) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(" ".join([net.switch_ns, *net.ns.values(), *map(str, net.pids(1))]), flush=True)
    time.sleep(600)
"""


@needs_netns
def test_teardown_on_sigterm() -> None:
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=REPO)
    try:
        line = child.stdout.readline().split()
        assert len(line) >= 5, child.stderr.read()
        ns, pids = line[:4], [int(p) for p in line[4:]]
        assert set(ns) <= set(namespaces())
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(ns) & set(namespaces()):
        time.sleep(0.1)
    assert not set(ns) & set(namespaces())
    assert not any(alive(p) for p in pids)


_GLOO_RANK = """
import json, sys, torch, torch.distributed as dist
rank, world, master, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
t = torch.ones(1 << 20)  # 4 MiB
dist.all_reduce(t)
dist.barrier()
print(json.dumps({"sum": float(t[0])}), flush=True)
dist.destroy_process_group()
"""
ALL_REDUCE_BYTES = 4 << 20


def _gloo_all_reduce(net: SwitchedNetwork, placement: list[int], port: int) -> int:
    """Bytes node 0's veth sent while ranks on ``placement``'s nodes (rank r on node
    ``placement[r]``, gloo bound to that node's veth) all-reduced 4 MiB."""
    before = net.counters(0)["tx_bytes"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [net.popen(node, [sys.executable, "-c", _GLOO_RANK, str(rank), str(len(placement)), net.addr[0], str(port)],
                       env={**env, "GLOO_SOCKET_IFNAME": net.dev[node]}, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
             for rank, node in enumerate(placement)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert json.loads(out)["sum"] == len(placement)
    return net.counters(0)["tx_bytes"] - before


@needs_netns
@pytest.mark.slow
def test_gloo_ranks_of_one_node_talk_over_its_loopback_and_ranks_of_two_nodes_over_the_switch() -> None:
    # gloo binds each process to the address of GLOO_SOCKET_IFNAME (the node's veth) and
    # connects to its peers' such addresses: a peer on the same node has the node's own
    # address, which the kernel routes over lo, so nothing of it crosses the veth
    with SwitchedNetwork(2, RATE) as net:
        same_node = _gloo_all_reduce(net, [0, 0], 29511)
        two_nodes = _gloo_all_reduce(net, [0, 1], 29512)
    assert_switch_gone(net)
    print(json.dumps({"veth_tx_bytes_same_node": same_node, "veth_tx_bytes_two_nodes": two_nodes}))
    assert same_node < 0.05 * ALL_REDUCE_BYTES, same_node
    assert two_nodes > 0.5 * ALL_REDUCE_BYTES, two_nodes
