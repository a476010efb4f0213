"""The framework integrations in two levels: Lightning's ``RaycompStrategy`` and the Hugging
Face Trainer under raycomp's ``prepare_trainer`` on the switched testbed, 2 Ray nodes x 2
workers (tests/support/switch_frameworks.py). With ``compression.levels`` at its default,
each finds the topology in Ray Train's context and reduces int8 steps in two levels: every
rank's parameters equal at the end, the same plan at every step on every rank, bytes sent
inside the nodes beside those that crossed them.

Long check (scripts/long-checks.sh).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.netns import needs_netns
from tests.support.step_logs import step_logs
from tests.support.testbed import drive

pytestmark = [needs_netns, pytest.mark.long]
pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

NODES, PER_NODE = 2, 2


@pytest.fixture(scope="module")
def frameworks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("frameworks2x2")
    output = work / "run"
    workers = NODES * PER_NODE
    report = drive(work, NODES, PER_NODE, "tests.support.switch_frameworks",
                   {"output": str(output), "nodes": NODES, "workers": workers, "name": f"frameworks-{work.name}"[:60]})
    print(json.dumps({"total_s": report["total_s"], "fit_s": round(report["fit_seconds"], 1)}))
    return {name: [json.loads((output / name / f"rank{r}.json").read_text()) for r in range(workers)]
            for name in ("lightning", "hf")}


@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_a_framework_reduces_in_two_levels_with_the_topology_from_ray_train(frameworks, framework) -> None:
    ranks = frameworks[framework]
    assert [r["world_size"] for r in ranks] == [NODES * PER_NODE] * len(ranks)
    assert sorted(sum(1 for r in ranks if r["node_ip"] == ip) for ip in {r["node_ip"] for r in ranks}) == \
        [PER_NODE] * NODES
    assert [r["reducer"] for r in ranks] == ["TwoLevelReducer"] * len(ranks)
    assert len({r["params"] for r in ranks}) == 1  # every rank ends with the same weights
    totals = ranks[0]
    assert totals["intra_node_bytes_total"] > 0 and 0 < totals["wire_bytes_total"]
    logs = step_logs(Path(ranks[0]["output_dir"]))
    assert len(logs) == len(ranks)  # every rank's log
    keys = ("step", "plan_version", "plan_digest", "applied")
    assert len(logs[0]) >= 8  # an epoch: 8 steps of 4 workers
    for records in logs[1:]:
        assert [tuple(rec[k] for k in keys) for rec in records] == [tuple(rec[k] for k in keys) for rec in logs[0]]
    print(json.dumps({"framework": framework, "steps": len(logs[0]), "wire": totals["wire_bytes_total"],
                      "intra": totals["intra_node_bytes_total"]}))
