"""What ``jobs.train`` prints about its policy: the link planned for, the plan chosen and why."""

from __future__ import annotations

from jobs.config import load_config
from jobs.policy_report import chosen, intro, link, outcome
from tests.support.repo import REPO

FASHION = str(REPO / "jobs" / "configs" / "fashion_mnist.yaml")


def test_the_main_job_runs_the_adaptive_default_planning_for_100_mbit():
    config = load_config(FASHION, [])
    assert config.compression.policy == "adaptive"
    assert config.compression.adaptive.bandwidth == 12.5e6
    lines = intro(config)
    assert lines[0] == "policy adaptive: plans for a 100 Mbit/s (12.5 MB/s per rank) link (compression.adaptive.bandwidth)"
    assert "planning figure" in lines[1] and "not a measurement of this machine's link" in lines[1]


def test_without_a_planning_bandwidth_the_job_says_it_measures_the_link():
    lines = intro(load_config(FASHION, ["compression.adaptive.bandwidth=null"]))
    assert len(lines) == 1 and lines[0].startswith("policy adaptive: measures the link it runs on")
    assert intro(load_config(FASHION, ["compression.policy=critical"])) == [
        "policy critical: it does not price the link (the adaptive default does)"]


def test_link_rates():
    assert link(12.5e6) == "100 Mbit/s (12.5 MB/s per rank)"
    assert link(1.25e9) == "10 Gbit/s (1.25e+03 MB/s per rank)"


def test_the_end_names_the_link_the_plan_its_reason_every_switch_and_the_bytes():
    reason = "slow link 12.5 MB/s, comm 1.1x compute → powersgd r=1 on 2; int4 on 1; 60 ms vs dense 256 ms"
    events = [{"step": 2, "kind": "plan", "reason": "warm-up: ... → int4 on 3", "why": {"rule": "warmup.adaptive.first"}},
              {"step": 9, "kind": "fallback", "reason": "nan"},
              {"step": 19, "kind": "plan", "reason": reason, "why": {"rule": "adaptive.first"}}]
    summary = {
        "policy": {"name": "adaptive", "plan_switches_by_rule": {"warmup.adaptive.first": 1, "adaptive.first": 1},
                   "events": events,
                   "policy_details": {"bandwidth_bytes_per_s": 12.5e6, "bandwidth_assumed": True}},
        "final_plan": {"version": 2, "default": {"name": "none"}, "dense": False, "reason": reason,
                       "layers": {"fc1.weight": {"name": "powersgd", "rank": 1}, "conv2.weight": {"name": "powersgd", "rank": 1},
                                  "fc2.weight": {"name": "int4"}, "conv1.weight": {"name": "none"}}},
        "wire_bytes_total": 2e6, "dense_bytes_total": 8e7,
    }
    lines = outcome(summary)
    assert lines[0] == ("policy adaptive, planned for a 100 Mbit/s (12.5 MB/s per rank) link "
                        "(a planning figure, not this machine's link)")
    assert lines[1] == "  chose at the end: powersgd r=1 on 2 layers, int4 on 1 layer, the rest dense (plan v2)"
    assert lines[2] == f"  why: {reason}"
    assert lines[3].startswith("  plan switches by rule: warmup.adaptive.first 1; adaptive.first 1 (a first decision")
    assert lines[4:6] == ["    step     2 [warmup.adaptive.first] warm-up: ... → int4 on 3",
                          f"    step    19 [adaptive.first] {reason}"]
    assert lines[6] == "  bytes: 2 MB on the wire against 80 MB dense (all ranks, the whole run): 40.0x fewer"
    # a plan kept by later decisions: the latest one's reason too
    details = summary["policy"]["policy_details"]
    details["history"] = [[19, 3, reason], [935, 3, "fast link ... → powersgd r=1 on 2; int4 on 1 (lossy not 30% faster)"]]
    assert outcome(summary)[3] == "  latest decision (step 935): fast link ... → powersgd r=1 on 2; int4 on 1 (lossy not 30% faster)"
    details["history"] = [[19, 3, reason]]
    assert outcome(summary) == lines
    # measured, not planned: said so
    summary["policy"]["policy_details"]["bandwidth_assumed"] = False
    assert outcome(summary)[0] == "policy adaptive, link measured at 100 Mbit/s (12.5 MB/s per rank)"


def test_plans_read_as_the_policy_writes_them():
    assert chosen(None) == "no plan reported"
    assert chosen({"dense": True, "layers": {}}) == "dense (the guard's fallback)"
    assert chosen({"default": {"name": "none"}, "layers": {"a": {"name": "none"}}}) == "dense"
    assert chosen({"default": {"name": "topk", "ratio": 0.01}, "layers": {}}) == "topk 0.01 on every layer"
    assert chosen({"default": {"name": "none"}, "layers": {"a": {"name": "int8"}}, "local": {"sync_every": 8}}) == (
        "int8 on 1 layer, the rest dense; local steps, H=8")
