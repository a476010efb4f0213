"""Correct past two ranks, for every transport and mode: ``raycomp.train`` on the switched
testbed (tests/support/switch_runs.py) at W = 3 (3 nodes x 1 worker), W = 4 (2 x 2) and
W = 8 (2 x 4).

* Every transport per step, one schedule through all of them (dense, PowerSGD's low-rank
  all-reduce, bf16 and Random-K over the summable all-reduce, sign, int4 and QSGD over the
  scalable two-round route, DGC's Top-K and the threshold over the all-gather): every rank's
  parameters and optimizer state bit-identical after every step, the same plan version and
  digest at every step on every rank. (Top-K and int8 at W = 3, 4 and 8:
  tests/test_switch_train.py.)
* Local steps at W = 4 and 8 (``compression.local`` fixed, ``sync_every`` 4, int8 pseudo-gradients,
  no delay): the replicas drift apart between syncs, are bit-identical right after each sync
  and at the end (after finish's merge), and the ranks agree on the plans.
* The same local steps between nodes (``compression.levels`` auto): the ranks of a node
  bit-identical after every step, the nodes drifting apart between syncs, and fewer bytes
  per rank crossing nodes than the flat run's.
* FSDP2 in two levels at W = 4 (sharded inside each node, each shard compressed across
  nodes): every shardable compressor in turn, the full parameters and optimizer state
  bit-identical on every rank after every step, fewer bytes crossing nodes than flat FSDP
  with the same schedule; a killed worker resumes from the distributed checkpoint bit for
  bit as the unbroken run (int4 from the first step: one plan for the whole run, so the
  comparison does not depend on when the controller answers).
* Checkpoint and resume at W = 4 and 8: step checkpoints every 5 steps, the rank on the second node
  killed at step 12 (FailureConfig(max_failures=1)), resumed from step 10; the run ends, and
  went through every step, bit-identical to the same plan unbroken (every rank's parameters,
  optimizer state and compression state: residuals, int4's server residuals, PowerSGD's Q,
  DGC's draws). One plan from the first step, PowerSGD, int4 and DGC's Top-K each on its
  own layer, so the comparison does not depend on when the controller answers.

One cluster per topology and one Ray Train fit in it trains every run of that topology in
turn (the killed run last: a restarted worker group skips the runs every rank finished).
Long checks (scripts/long-checks.sh); times in docs/testing.md.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.netns import needs_netns
from tests.support.testbed import drive

pytestmark = [needs_netns, pytest.mark.long]

#: every transport but dense-only, a few steps each (warm-up: steps 0 and 1 dense), under the
#: guard's default threshold: a healthy run of each falls back nowhere, flat or in two levels
TRANSPORTS = {"name": "transports", "kind": "steps", "epochs": 4, "steps_per_epoch": 9, "warmup": 2,
              "stages": [[0, "powersgd", {"rank": 2}], [8, "bf16", {}], [12, "randomk", {"ratio": 0.1}],
                         [16, "sign", {}], [20, "int4", {}], [24, "qsgd", {}],
                         [28, "dgc_topk", {"ratio": 0.1}], [32, "threshold", {"threshold": 1e-3}]]}
#: which transport each carries (raycomp.compressors: ``transport``)
CARRIED = {"none": "dense", "powersgd": "lowrank", "bf16": "allreduce", "randomk": "allreduce",
           "sign": "scalable", "int4": "scalable", "qsgd": "scalable", "dgc_topk": "allgather",
           "threshold": "allgather"}
#: the same schedule in two levels (compression.levels=auto: the topology from Ray Train)
TWO_LEVEL = {**TRANSPORTS, "name": "two_level", "levels": "auto"}
LOCAL = {"name": "local", "kind": "local", "epochs": 2, "steps_per_epoch": 9, "warmup": 2, "sync_every": 4,
         "local_compressor": "int8"}
#: the same local steps between nodes: a node is one replica, data-parallel inside
NODE_REPLICAS = {**LOCAL, "name": "node_replicas", "levels": "auto"}
#: and with each sync's cross-node hop in flight beside the next inner step (the default delay)
NODE_REPLICAS_DELAYED = {**NODE_REPLICAS, "name": "node_replicas_delayed", "delay": 1}
#: the resume drills: 24 steps, a step checkpoint every 5; rank 3 killed at step 12, resumed from step 10
DRILL = {"epochs": 2, "steps_per_epoch": 12, "every_steps": 5}
KILL_STEP, RESUME_STEP = 12, 10
#: resumed: one plan for the whole run, a compressor per layer (tests/support/layer_plan_policy.py)
#: from three transports, each with state the checkpoint must carry: PowerSGD (low-rank: its
#: Q), int4 (scalable: server residuals per rank) and DGC's Top-K (all-gather: its sampling
#: draws), every layer with its error-feedback residual. The controller decides the plan at
#: registration (no warm-up) and never changes it, so both runs step under the same plan at
#: every step however late the controller answers (a scheduled switch lands when its answer
#: arrives, which made the two runs differ by timing)
RESUMED = {**DRILL, "kind": "layers", "warmup": 0,
           "layers": {"0.weight": ["powersgd", {"rank": 2}], "0.bias": ["int4", {}],
                      "2.weight": ["dgc_topk", {"ratio": 0.1}], "2.bias": ["int4", {}]}}
#: each layer's compressor under that plan and the transport it sends by
RESUMED_ROUTES = {"0.weight": ["powersgd", "lowrank"], "0.bias": ["int4", "scalable"],
                  "2.weight": ["dgc_topk", "allgather"], "2.bias": ["int4", "scalable"]}
#: FSDP: the compressors that fit a shard, in turn
FSDP_STAGES = [[0, "int8", {}], [8, "bf16", {}], [12, "int4", {}], [20, "sign", {}], [26, "qsgd", {}]]
FSDP_LEVELS = {**TRANSPORTS, "name": "fsdp_levels", "strategy": "fsdp", "levels": "auto", "stages": FSDP_STAGES}
FSDP_FLAT = {**FSDP_LEVELS, "name": "fsdp_flat", "levels": "flat"}
#: FSDP resumed: int4 (server residuals per rank) from step 0, one plan for the whole run:
#: the controller decides it at registration (no warm-up) and never changes it, so both runs
#: step under the same plan at every step however late the controller answers (a plan
#: switch lands when its answer arrives, which would make the two runs differ by timing)
FSDP_RESUMED = {**DRILL, "kind": "steps", "strategy": "fsdp", "levels": "auto", "warmup": 0,
                "stages": [[0, "int4", {}]]}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_testbed(work: Path, nodes: int, per_node: int, runs: list[dict], max_failures: int = 0) -> dict[str, Any]:
    """Start the testbed and one fit of ``runs``; what the tests read."""
    workers = nodes * per_node
    output = work / "run"
    report = drive(work, nodes, per_node, "tests.support.switch_runs",
                   {"output": str(output), "nodes": nodes, "workers": workers, "runs": runs,
                    "max_failures": max_failures, "name": f"modes-{nodes}x{per_node}-{work.name}"[:60]})
    net, node_of_inode = report["net"], report["node_of_inode"]
    print(json.dumps({"topology": f"{nodes}x{per_node}", "cluster_up_s": report["cluster_up_s"],
                      "fit_s": round(report["fit_seconds"], 1), "total_s": report["total_s"],
                      "run_s": report["run_seconds"]}))  # the last worker group's runs
    bed = {"workers": workers, "nodes": nodes, "per_node": per_node, "net": net, "node_of_inode": node_of_inode,
           "runs": {}}
    for run in runs:
        d = output / run["name"]
        bed["runs"][run["name"]] = {
            "dir": d,
            "ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(workers)],
            "digests": [_read_jsonl(d / "digests" / f"rank{r}.jsonl") for r in range(workers)],
            "steps": [_read_jsonl(d / "steps" / f"rank{r}.jsonl") for r in range(workers)],
            "totals": json.loads((d / "totals.json").read_text()),
        }
    return bed


@pytest.fixture(scope="module")
def bed_3x1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_testbed(tmp_path_factory.mktemp("modes3x1"), 3, 1, [TRANSPORTS])


def _every_mode(tmp_path_factory: pytest.TempPathFactory, nodes: int, per_node: int) -> dict[str, Any]:
    """Every transport, local steps, and the resume drill (rank 3 killed) in one fit."""
    killed = {**RESUMED, "name": "killed", "kill": {"rank": 3, "step": KILL_STEP}}
    return _run_testbed(tmp_path_factory.mktemp(f"modes{nodes}x{per_node}"), nodes, per_node,
                        [TRANSPORTS, TWO_LEVEL, LOCAL, NODE_REPLICAS, NODE_REPLICAS_DELAYED,
                         {**RESUMED, "name": "unbroken"}, killed],
                        max_failures=1)


@pytest.fixture(scope="module")
def bed_2x2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _every_mode(tmp_path_factory, 2, 2)


@pytest.fixture(scope="module")
def bed_fsdp_2x2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    killed = {**FSDP_RESUMED, "name": "fsdp_killed", "kill": {"rank": 3, "step": KILL_STEP}}
    return _run_testbed(tmp_path_factory.mktemp("fsdp2x2"), 2, 2,
                        [FSDP_LEVELS, FSDP_FLAT, {**FSDP_RESUMED, "name": "fsdp_unbroken"}, killed], max_failures=1)


@pytest.fixture(scope="module")
def bed_2x4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _every_mode(tmp_path_factory, 2, 4)


def last_per_step(records: list[dict]) -> dict[int, dict]:
    """A rank's digest records by step; a replayed step's last record (what the run kept)."""
    return {rec["step"]: rec for rec in records}


def assert_spread(bed: dict[str, Any], ranks: list[dict]) -> None:
    """The ranks sit per_node in each node's namespace, gloo bound to that node's veth."""
    net = bed["net"]
    node = [bed["node_of_inode"].get(r["netns_inode"]) for r in ranks]
    assert Counter(node) == dict.fromkeys(range(bed["nodes"]), bed["per_node"]), ranks
    assert [r["node_ip"] for r in ranks] == [net.addr[i] for i in node], ranks
    assert [r["gloo_socket_ifname"] for r in ranks] == [net.dev[i] for i in node], ranks
    assert all(r["world_size"] == bed["workers"] for r in ranks)


def assert_plans_agree(logs: list[list[dict]], steps: int) -> None:
    """Every rank logged every step once, with the same plan version and digest as rank 0."""
    keys = ("step", "plan_version", "plan_digest", "dense", "applied")
    for r, records in enumerate(logs):
        assert [rec["step"] for rec in records] == list(range(steps)), r
        assert [tuple(rec[k] for k in keys) for rec in records] == [tuple(rec[k] for k in keys) for rec in logs[0]], r
    assert all(rec["applied"] and not rec["fallback"] for rec in logs[0])


def assert_identical_after_every_step(digests: list[list[dict]], steps: int) -> None:
    """Parameters and optimizer state bit-identical on every rank after every step."""
    by_rank = [last_per_step(records) for records in digests]
    for step in range(steps):
        at = [rank[step] for rank in by_rank]
        assert len({d["params"] for d in at}) == 1, (step, at)
        assert len({d["optimizer"] for d in at}) == 1, (step, at)
        assert len({d["plan"] for d in at}) == 1, (step, at)


@pytest.mark.parametrize("topology", ["3x1", "2x2", "2x4"])
def test_every_transport_keeps_replicas_bit_identical_per_step(request: pytest.FixtureRequest, topology: str) -> None:
    bed = request.getfixturevalue(f"bed_{topology}")
    run = bed["runs"]["transports"]
    steps = TRANSPORTS["epochs"] * TRANSPORTS["steps_per_epoch"]
    assert_spread(bed, run["ranks"])
    assert [r["steps"] for r in run["ranks"]] == [steps] * bed["workers"]
    assert len({r["params"] for r in run["ranks"]}) == 1 and len({r["optimizer"] for r in run["ranks"]}) == 1
    assert run["ranks"][0]["params"] != run["ranks"][0]["params_before"]
    assert_identical_after_every_step(run["digests"], steps)
    assert_plans_agree(run["steps"], steps)
    # every compressor of the schedule ran, a step or more each: every transport at this W
    ran = Counter(rec["plan"] for rec in run["digests"][0])
    assert set(ran) == set(CARRIED), ran
    assert set(CARRIED[name] for name in ran) == {"dense", "lowrank", "allreduce", "scalable", "allgather"}
    assert len({rec["plan_digest"] for rec in run["steps"][0]}) >= len(CARRIED)
    # and the replicas moved at every step (a step that changed nothing would prove nothing)
    params = [rec["params"] for rec in run["digests"][0]]
    assert len(set(params)) == steps
    totals = run["totals"]
    assert totals["wire_bytes_total"] < totals["dense_bytes_total"]
    print(json.dumps({"topology": topology, "steps_per_compressor": dict(ran)}))


@pytest.mark.parametrize("topology", ["2x2", "2x4"])
def test_two_levels_keep_replicas_bit_identical_per_step(request: pytest.FixtureRequest, topology: str) -> None:
    """Ray Train's context gives the topology; every transport across nodes, dense inside,
    replicas bit-identical after every step, and fewer bytes per rank than the flat run."""
    bed = request.getfixturevalue(f"bed_{topology}")
    run, flat = bed["runs"]["two_level"], bed["runs"]["transports"]
    steps = TWO_LEVEL["epochs"] * TWO_LEVEL["steps_per_epoch"]
    assert_spread(bed, run["ranks"])
    assert [r["reducer"] for r in run["ranks"]] == ["TwoLevelReducer"] * bed["workers"]
    assert [r["reducer"] for r in flat["ranks"]] == ["CompressedReducer"] * bed["workers"]
    assert [r["steps"] for r in run["ranks"]] == [steps] * bed["workers"]
    assert_identical_after_every_step(run["digests"], steps)
    assert_plans_agree(run["steps"], steps)
    assert set(Counter(rec["plan"] for rec in run["digests"][0])) == set(CARRIED)
    assert run["ranks"][0]["params"] != flat["ranks"][0]["params"]  # it took its own path
    assert run["totals"]["wire_bytes_total"] < flat["totals"]["wire_bytes_total"]
    assert run["totals"]["intra_node_bytes_total"] > 0 == flat["totals"]["intra_node_bytes_total"]
    print(json.dumps({"topology": topology, "wire_two_level": run["totals"]["wire_bytes_total"],
                      "wire_flat": flat["totals"]["wire_bytes_total"]}))


@pytest.mark.parametrize("topology", ["2x2", "2x4"])
def test_local_steps_drift_between_syncs_and_agree_after_each(request: pytest.FixtureRequest, topology: str) -> None:
    bed = request.getfixturevalue(f"bed_{topology}")
    run = bed["runs"]["local"]
    steps = LOCAL["epochs"] * LOCAL["steps_per_epoch"]
    assert_spread(bed, run["ranks"])
    # the end, after finish's merge: every rank holds the same weights
    assert len({r["params"] for r in run["ranks"]}) == 1, run["ranks"]
    assert run["ranks"][0]["params"] != run["ranks"][0]["params_before"]
    assert_plans_agree(run["steps"], steps)
    by_rank = [last_per_step(records) for records in run["digests"]]
    syncs, drifted = [], []
    for step in range(steps):
        at = [rank[step] for rank in by_rank]
        assert len({d["outer_steps"] for d in at}) == 1, (step, at)  # every rank synced at the same steps
        same = len({d["params"] for d in at}) == 1
        synced = at[0]["outer_steps"] > (by_rank[0][step - 1]["outer_steps"] if step else 0)
        if synced or step < LOCAL["warmup"] or step == steps - 1:  # a sync, the dense warm-up, the merge
            assert same, (step, at)
        elif not same:
            drifted.append(step)
        if synced:
            syncs.append(step)
    # a sync every sync_every steps after the warm-up
    assert len(syncs) >= (steps - LOCAL["warmup"]) // LOCAL["sync_every"], syncs
    assert all(b - a <= LOCAL["sync_every"] for a, b in zip(syncs, syncs[1:], strict=False)), syncs
    # between syncs each rank trained on its own data: the replicas did drift apart
    assert len(drifted) >= len(syncs) - 1, (syncs, drifted)
    assert run["ranks"][0]["outer_steps"] == by_rank[0][steps - 1]["outer_steps"] >= len(syncs)
    print(json.dumps({"syncs_at": syncs, "drifted_at": drifted}))


@pytest.mark.parametrize("topology", ["2x2", "2x4"])
def test_local_steps_between_nodes_keep_each_node_one_replica(request: pytest.FixtureRequest, topology: str) -> None:
    bed = request.getfixturevalue(f"bed_{topology}")
    run, flat = bed["runs"]["node_replicas"], bed["runs"]["local"]
    steps, per_node = NODE_REPLICAS["epochs"] * NODE_REPLICAS["steps_per_epoch"], bed["per_node"]
    assert_spread(bed, run["ranks"])
    assert [r["reducer"] for r in run["ranks"]] == ["TwoLevelReducer"] * bed["workers"]
    assert [r["reducer"] for r in flat["ranks"]] == ["CompressedReducer"] * bed["workers"]
    assert len({r["params"] for r in run["ranks"]}) == 1, run["ranks"]  # merged at the end
    assert_plans_agree(run["steps"], steps)
    by_rank = [last_per_step(records) for records in run["digests"]]
    nodes = {ip: [r["rank"] for r in run["ranks"] if r["node_ip"] == ip] for ip in {r["node_ip"] for r in run["ranks"]}}
    assert sorted(len(ranks) for ranks in nodes.values()) == [per_node] * bed["nodes"]
    drifted = 0
    for step in range(steps):
        at = [rank[step] for rank in by_rank]
        for ip, ranks in nodes.items():
            assert len({at[r]["params"] for r in ranks}) == 1, (step, ip)
        drifted += len({d["params"] for d in at}) > 1
    assert drifted >= (steps - NODE_REPLICAS["warmup"]) // 2, drifted  # the nodes did train apart
    assert run["ranks"][0]["outer_steps"] == flat["ranks"][0]["outer_steps"] > 0
    assert run["totals"]["wire_bytes_total"] < flat["totals"]["wire_bytes_total"]
    print(json.dumps({"topology": topology, "wire_node_replicas": run["totals"]["wire_bytes_total"],
                      "wire_flat_local": flat["totals"]["wire_bytes_total"], "drifted_steps": drifted}))


@pytest.mark.parametrize("topology", ["2x2", "2x4"])
def test_node_replicas_with_a_delay_keep_each_node_one_replica_and_land_every_sync(
        request: pytest.FixtureRequest, topology: str) -> None:
    """``delay`` 1: each sync's cross-node hop runs beside the next inner step and lands
    there; a node's ranks stay equal after every step and every rank ends equal."""
    bed = request.getfixturevalue(f"bed_{topology}")
    run, undelayed = bed["runs"]["node_replicas_delayed"], bed["runs"]["node_replicas"]
    steps = NODE_REPLICAS_DELAYED["epochs"] * NODE_REPLICAS_DELAYED["steps_per_epoch"]
    assert_spread(bed, run["ranks"])
    assert len({r["params"] for r in run["ranks"]}) == 1, run["ranks"]  # merged at the end
    assert_plans_agree(run["steps"], steps)
    by_rank = [last_per_step(records) for records in run["digests"]]
    nodes = {ip: [r["rank"] for r in run["ranks"] if r["node_ip"] == ip] for ip in {r["node_ip"] for r in run["ranks"]}}
    for step in range(steps):
        at = [rank[step] for rank in by_rank]
        for ip, ranks in nodes.items():
            assert len({at[r]["params"] for r in ranks}) == 1, (step, ip)
        assert len({d["outer_steps"] for d in at}) == 1, (step, at)

    def landed(records: list[dict]) -> list[int]:
        by_step = last_per_step(records)
        return [s for s in range(1, steps) if by_step[s]["outer_steps"] > by_step[s - 1]["outer_steps"]]

    # every sync lands one step after the undelayed run's (the last: the end's merge)
    delayed, at_once = landed(run["digests"][0]), landed(undelayed["digests"][0])
    assert len(delayed) >= 3 and {s - 1 for s in delayed[:-1]} <= set(at_once), (delayed, at_once)
    assert run["ranks"][0]["params"] != undelayed["ranks"][0]["params"]  # the delay's step kept its own progress
    print(json.dumps({"topology": topology, "landed_at": delayed, "undelayed_at": at_once}))


@pytest.mark.parametrize("topology", ["2x2", "2x4"])
def test_a_killed_worker_resumes_bit_identical_to_the_unbroken_run(request: pytest.FixtureRequest,
                                                                  topology: str) -> None:
    bed = request.getfixturevalue(f"bed_{topology}")
    unbroken, killed = bed["runs"]["unbroken"], bed["runs"]["killed"]
    steps, workers = RESUMED["epochs"] * RESUMED["steps_per_epoch"], bed["workers"]
    assert_spread(bed, killed["ranks"])
    # the worker group restarted: every rank resumed from the step-10 checkpoint in new processes
    assert [r["restored_from"] for r in killed["ranks"]] == [RESUME_STEP] * workers
    assert [r["restored_from"] for r in unbroken["ranks"]] == [0] * workers
    assert (killed["dir"] / "faults" / f"killed-at-{KILL_STEP}").exists()
    # rank 3 logged up to its kill; the replayed steps were logged again
    assert max(rec["step"] for rec in killed["digests"][3][:KILL_STEP]) == KILL_STEP - 1
    assert len(killed["digests"][0]) > steps
    for run in (unbroken, killed):
        assert [r["steps"] for r in run["ranks"]] == [steps] * workers
        assert_plans_agree(run["steps"], steps)
        assert_identical_after_every_step(run["digests"], steps)
    # the one plan held at every step of both runs: no warm-up, no fallback, no other version,
    # and every layer went through its compressor by its transport (every rank's last record
    # of a step: a replayed step's included)
    plans = {(rec["plan_version"], rec["plan_digest"]) for run in (unbroken, killed) for rec in run["steps"][0]}
    assert len(plans) == 1, plans
    for run in (unbroken, killed):
        assert not any(rec["dense"] for rec in run["steps"][0])
        for records in run["digests"]:
            assert all(rec["routes"] == RESUMED_ROUTES for rec in last_per_step(records).values())
    # bit for bit the unbroken run: at every step, and at the end each rank's parameters,
    # optimizer state and compression state (error feedback, int4's server residuals,
    # PowerSGD's Q, DGC's draws)
    ref, got = last_per_step(unbroken["digests"][0]), last_per_step(killed["digests"][0])
    for step in range(steps):
        assert (got[step]["params"], got[step]["optimizer"]) == (ref[step]["params"], ref[step]["optimizer"]), step
    keys = ("params", "optimizer", "compression")
    assert [[r[k] for k in keys] for r in killed["ranks"]] == [[r[k] for k in keys] for r in unbroken["ranks"]]
    assert len({r["compression"] for r in unbroken["ranks"]}) == workers  # each rank's own residuals


def test_fsdp_in_two_levels_keeps_every_node_identical_and_sends_less_across_nodes(bed_fsdp_2x2) -> None:
    bed = bed_fsdp_2x2
    run, flat = bed["runs"]["fsdp_levels"], bed["runs"]["fsdp_flat"]
    steps = FSDP_LEVELS["epochs"] * FSDP_LEVELS["steps_per_epoch"]
    assert_spread(bed, run["ranks"])
    assert [r["reducer"] for r in run["ranks"]] == ["CompressedReducer"] * bed["workers"]  # the cross-node hop's
    assert [r["reducer"] for r in flat["ranks"]] == ["NoneType"] * bed["workers"]  # flat: comms, no reducer
    for r in (run, flat):
        assert [rank["steps"] for rank in r["ranks"]] == [steps] * bed["workers"]
        assert_identical_after_every_step(r["digests"], steps)
        assert_plans_agree(r["steps"], steps)
    ran = Counter(rec["plan"] for rec in run["digests"][0])
    assert set(ran) == {"none", "int8", "bf16", "int4", "sign", "qsgd"}, ran
    assert len({rec["params"] for rec in run["digests"][0]}) == steps  # it moved at every step
    assert run["ranks"][0]["params"] != flat["ranks"][0]["params"]  # it took its own path
    assert run["totals"]["wire_bytes_total"] < flat["totals"]["wire_bytes_total"]
    assert run["totals"]["intra_node_bytes_total"] > 0 == flat["totals"]["intra_node_bytes_total"]
    print(json.dumps({"wire_fsdp_two_level": run["totals"]["wire_bytes_total"],
                      "wire_fsdp_flat": flat["totals"]["wire_bytes_total"], "steps_per_compressor": dict(ran)}))


def test_fsdp_in_two_levels_resumes_a_killed_worker_bit_for_bit(bed_fsdp_2x2) -> None:
    bed = bed_fsdp_2x2
    unbroken, killed = bed["runs"]["fsdp_unbroken"], bed["runs"]["fsdp_killed"]
    steps, workers = FSDP_RESUMED["epochs"] * FSDP_RESUMED["steps_per_epoch"], bed["workers"]
    assert [r["restored_from"] for r in killed["ranks"]] == [RESUME_STEP] * workers
    assert (killed["dir"] / "faults" / f"killed-at-{KILL_STEP}").exists()
    for run in (unbroken, killed):
        assert [r["steps"] for r in run["ranks"]] == [steps] * workers
        assert_identical_after_every_step(run["digests"], steps)
    ref, got = last_per_step(unbroken["digests"][0]), last_per_step(killed["digests"][0])
    for step in range(steps):
        assert (got[step]["params"], got[step]["optimizer"]) == (ref[step]["params"], ref[step]["optimizer"]), step
    keys = ("params", "optimizer", "compression")
    assert [[r[k] for k in keys] for r in killed["ranks"]] == [[r[k] for k in keys] for r in unbroken["ranks"]]
    for run in (unbroken, killed):  # the one plan held at every step: no warm-up, no fallback
        assert {rec["plan"] for rec in run["digests"][0]} == {"int4"}
        assert not any(rec["dense"] for rec in run["steps"][0])
