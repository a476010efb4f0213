"""Every policy's state is one typed dataclass, saved and read back by one generic serialiser
(``controllers/policies/serial.py``): a whole state survives JSON, and a fresh policy given
it decides as the original would."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from raycomp.controllers.policies import make_policy, serial
from raycomp.controllers.policies.local_state import LocalState, Measured
from raycomp.plan import CompressorSpec, Plan
from tests.support.policy_replay import _ReplaySim, _scenario
from tests.support.policy_sim import SLOW, Sim

#: one seed of each kind of recorded run (tests.support.policy_replay), local steps included
KINDS = ("adaptive", "local_auto", "local_fixed", "critical", "error_budget", "bandwidth", "schedule", "static")


def _seed_of(kind: str) -> int:
    return next(seed for seed in range(200) if _scenario(seed)["kind"] == kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_policys_whole_state_round_trips_and_decides_the_same(kind):
    sim = _ReplaySim(_scenario(_seed_of(kind)))
    sim.lr = 0.1
    sim.run(12, SLOW)
    policy = sim.controller.policies["run"]
    saved = json.loads(json.dumps(policy.state_dict()))
    name, options = sim.registered
    fresh = make_policy(name, {**options, "min_compress_numel": 1024})
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    chain_a, chain_b = policy, fresh
    while chain_a is not None:  # every wrapper and the policy it wraps
        assert type(chain_b.state) is type(chain_a.state) and chain_b.state == chain_a.state
        chain_a, chain_b = chain_a.inner, chain_b.inner
    run = sim.controller.runs["run"]
    assert fresh.decide(run) == policy.decide(run)
    assert fresh.state == policy.state


def test_the_local_state_holds_typed_records_not_positional_lists():
    sim = _ReplaySim(_scenario(_seed_of("local_auto")))
    sim.run(30, SLOW)
    state = sim.controller.policies["run"].inner.state
    assert isinstance(state, LocalState) and state.history
    loaded = serial.load(LocalState, json.loads(json.dumps(serial.dump(state))))
    assert loaded == state
    assert all(type(r).__name__ == "LocalRecord" for r in loaded.history)


@dataclass
class _Toy:
    count: int = 0
    best: float | None = None
    names: set[str] = field(default_factory=set)
    plan: Plan | None = None
    seen: list[Measured] = field(default_factory=list)
    by_layer: dict[str, int] = field(default_factory=dict)


def test_the_serialiser_saves_every_supported_type_and_reads_it_back():
    toy = _Toy(3, 0.5, {"b", "a"}, Plan.per_layer({"w": CompressorSpec.of("int8")}, reason="r"),
               [Measured(4, 0.1, 0.02)], {"w": 2})
    saved = json.loads(json.dumps(serial.dump(toy)))
    assert saved["schema"] == serial.SCHEMA and saved["type"] == "_Toy"
    assert saved["fields"]["names"] == ["a", "b"]  # a set is saved sorted: the same file every time
    assert serial.load(_Toy, saved) == toy


def test_a_field_added_after_a_snapshot_loads_with_its_default():
    saved = serial.dump(_Toy(count=2))
    del saved["fields"]["by_layer"]
    del saved["fields"]["best"]
    assert serial.load(_Toy, saved) == _Toy(count=2)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.update(schema=0), r"^policy state: schema 0 is not the supported 1$"),
    (lambda s: s.update(type="Other"), r"^policy state: saved for 'Other', loading into '_Toy'$"),
    (lambda s: s["fields"].update(extra=1), r"^_Toy: unknown fields \['extra'\]; _Toy has \[.*'count'.*\]$"),
    (lambda s: s["fields"].update(count="3"), r"^_Toy.count: expected int, got '3'$"),
    (lambda s: s["fields"].update(seen=[{"h": 4, "compute": 0.1}]),
     r"^_Toy.seen\[0\]: missing fields \['wait'\]; they have no default$"),
    (lambda s: s.pop("fields"), r"^policy state: expected \{schema, type, fields\}"),
])
def test_a_bad_saved_state_is_refused_in_one_line_naming_the_field(edit, message):
    saved = serial.dump(_Toy(seen=[Measured(4, 0.1, 0.02)]))
    edit(saved)
    with pytest.raises(ValueError, match=message):
        serial.load(_Toy, saved)


def test_each_plan_switch_carries_its_decisions_facts_to_the_summary_and_the_metrics():
    from raycomp.controllers.exporter import ControllerCollector

    sim = Sim()
    sim.run(8, SLOW)
    summary = sim.controller.summary("run")
    plans = [e for e in summary["events"] if e["kind"] == "plan"]
    assert plans and all("why" in e for e in plans)
    for event in plans:
        assert event["why"]["rule"].startswith(("adaptive.", "warmup.", "guard.", "kept"))
    compressed = [e["why"] for e in plans if e["why"]["rule"].startswith("adaptive.")]
    assert compressed, "the adaptive policy compressed on a slow link"
    why = compressed[-1]
    assert why["bandwidth"] > 0 and len(why["predicted"]) == why["top"] + 1 and why["groups"]
    assert sum(summary["plan_switches_by_rule"].values()) == summary["plan_switches"]
    families = {f.name: f for f in ControllerCollector(sim.controller).collect()}
    samples = {s.labels["rule"]: s.value for s in families["raycomp_plan_switches"].samples
               if s.name == "raycomp_plan_switches_total"}
    assert samples == {rule: float(n) for rule, n in summary["plan_switches_by_rule"].items()}


def test_a_decisions_facts_name_its_rule_and_a_plain_why_gives_its_rule_alone():
    from raycomp.controllers.policies import Decision, Said
    from raycomp.controllers.policies.adaptive_why import WarmupWhy

    class Plain:
        rule = "mine"

        def text(self) -> str:
            return "my words"

    decision = Decision.of(Plan(), Plain())
    assert decision.plan.reason == "my words" and decision.facts() == {"rule": "mine"}
    warm = Decision.of(Plan(), WarmupWhy(Said("adaptive.unmeasured", "dense until timed")))
    assert warm.plan.reason == "warm-up: dense until timed"
    assert warm.facts() == {"rule": "warmup.adaptive.unmeasured",
                            "inner": {"rule": "adaptive.unmeasured", "words": "dense until timed"}}
