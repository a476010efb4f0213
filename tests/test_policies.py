"""Controller policies on hand-built RunStates fed through the real report aggregation."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from raycomp.controllers.policies import POLICIES, FallbackGate, make_policy
from raycomp.controllers.policies.bandwidth import BandwidthPolicy
from raycomp.controllers.policies.critical import CriticalPolicy
from raycomp.controllers.policies.error_budget import ErrorBudgetPolicy, choose_ratios, error_bins
from raycomp.controllers.state import RunState
from raycomp.messages import GradStats
from raycomp.plan import DENSE, CompressorSpec, Plan

BIG, SMALL = 4096, 10


def typed(name: str, **overrides):
    """A policy's typed options: its options model's defaults + overrides."""
    return POLICIES[name].options_model(**overrides)


def options(name: str, **overrides) -> dict:
    """A policy's options exactly as the service passes them (pydantic defaults + overrides)."""
    return {**typed(name, **overrides).model_dump(mode="json"), "min_compress_numel": 1024}


def new_run(layers: dict[str, int], world_size: int = 2, interval_steps: int = 1,
            policy: str = "critical") -> RunState:
    return RunState("r", world_size, layers, policy, {}, interval_steps=interval_steps)


def feed(run: RunState, step: int, norms: dict[str, float] | None = None, *,
         profiles: dict[str, dict[float, float]] | None = None, fallback: bool = False,
         wire: float = 0.0, dense: float = 0.0, comm: float = 0.01, compute: float = 0.1) -> None:
    """One boundary step reported by every rank (wire/dense: each rank's running totals)."""
    norms, profiles = norms or {}, profiles or {}
    layers = []
    for name, h in run.layers.items():
        layer = {"layer": name, "compressor": "topk", "numel": h.numel,
                 "grad_norm": norms.get(name, 1.0), "compression_error": 0.1,
                 "residual_norm": 0.0, "wire_bytes": 0.0, "dense_bytes": 0.0}
        if name in profiles:
            layer["topk_errors"] = {str(r): e for r, e in profiles[name].items()}
        layers.append(layer)
    merged = False
    for rank in range(run.world_size):
        merged = run.add(GradStats.from_dict({
            "run_id": run.run_id, "rank": rank, "step": step, "epoch": 0, "plan_version": 0,
            "loss": 1.0, "step_seconds": comm + compute, "compute_seconds": compute,
            "comm_seconds": comm, "samples_per_second": 100.0, "wire_bytes": wire,
            "dense_bytes": dense, "fallback_active": fallback, "layers": layers}))
    assert merged and run.step == step


def ratio_of(plan: Plan, layer: str) -> float | None:
    s = plan.spec_for(layer)
    return None if s.is_dense else dict(s.params)["ratio"]


# --- static / schedule ---------------------------------------------------------------------
def test_static_plan() -> None:
    run = new_run({"a": BIG})
    feed(run, 0)
    plan = make_policy("static", options("static")).decide(run).plan
    assert plan.default == CompressorSpec.of("topk", ratio=0.01) and not plan.dense


def test_schedule_stage_applies_from_the_step_after_the_boundary() -> None:
    policy = make_policy("schedule", options("schedule"))
    run = new_run({"a": BIG})
    expected = {0: 0.25, 48: 0.25, 49: 0.06, 50: 0.06, 98: 0.06, 99: 0.015, 149: 0.004, 500: 0.004}
    for step, ratio in expected.items():
        feed(run, step)
        assert ratio_of(policy.decide(run).plan, "a") == ratio, step


# --- critical (Accordion) ----------------------------------------------------------------
def test_critical_switches_on_norm_change_between_windows() -> None:
    opts = options("critical", window_steps=4, threshold=0.5)
    policy = make_policy("critical", opts)
    low, high = CompressorSpec.from_dict(opts["low"]), CompressorSpec.from_dict(opts["high"])
    run = new_run({"a": BIG, "b": BIG, "tiny": SMALL}, interval_steps=2)
    # windows end at detections 2, 6, 10, 14, 18; a jumps x3 after step 10, b only +40%
    seen = {}
    for step in range(2, 20, 2):
        feed(run, step, {"a": 1.0 if step <= 10 else 3.0, "b": 1.0 if step <= 10 else 1.4})
        plan = policy.decide(run).plan
        assert plan.spec_for("tiny") == DENSE
        seen[step] = (plan.spec_for("a"), plan.spec_for("b"))
    assert seen[2] == seen[4] == (low, low)  # first window: everything critical
    assert seen[6] == seen[8] == (high, high)  # unchanged norms
    assert seen[10] == seen[12] == (high, high)
    assert seen[14] == seen[16] == (low, high)  # a: +200% >= 50%; b: +40% < 50%
    assert seen[18] == (high, high)  # a is stable at its new level
    details = policy.details()
    assert details["detections"] == 5 and details["guard_suppressed_decisions"] == 0
    assert details["regime_counts"]["a"] == {"low": 2, "high": 3}
    assert details["last_regimes"] == {"a": "high", "b": "high"}


def test_critical_keeps_regime_of_layers_without_statistics() -> None:
    policy = CriticalPolicy(typed("critical", window_steps=1))
    run = new_run({"a": BIG})
    feed(run, 0)
    policy.decide(run)
    run.step = 5  # a merged step without layer statistics in the window
    assert policy.decide(run).plan.spec_for("a") == policy.options.low.spec()
    assert policy.state.prev_norms == {"a": 1.0}


# --- error budget (L-GreCo) -----------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_choose_ratios_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers, options_n = rng.randint(3, 5), rng.randint(3, 4)
    costs = [[rng.uniform(1, 100) for _ in range(options_n)] for _ in range(layers)]
    errors = [[rng.uniform(0, 1) for _ in range(options_n)] for _ in range(layers)]
    budget = rng.uniform(0.2, 0.8) * sum(max(row) for row in errors)
    bins = rng.choice([20, 50, 400])
    rounded = error_bins(errors, budget, bins)
    best = min(
        (sum(costs[i][c] for i, c in enumerate(pick))
         for pick in itertools.product(range(options_n), repeat=layers)
         if sum(rounded[i][c] for i, c in enumerate(pick)) <= bins),
        default=None,
    )
    picked = choose_ratios(costs, errors, budget, bins)
    if best is None:
        assert picked is None
        return
    assert picked is not None
    assert sum(costs[i][c] for i, c in enumerate(picked)) <= best + 1e-9
    assert sum(errors[i][c] for i, c in enumerate(picked)) <= budget * (1 + 1e-12)


def test_choose_ratios_edge_cases() -> None:
    assert choose_ratios([[1, 2]], [[0.5, 0.0]], 0.0) == [1]  # zero budget: only exact options
    assert choose_ratios([[1, 2]], [[0.5, 0.4]], 0.0) is None
    assert choose_ratios([], [], 1.0) == []


def test_error_budget_compresses_flat_profiles_harder_within_budget() -> None:
    opts = options("error_budget", ratios=[0.001, 0.01, 0.1], reference_ratio=0.01, slack=0.1,
                   every_steps=5)
    policy = make_policy("error_budget", opts)
    run = new_run({"flat": 100_000, "steep": 100_000, "unmeasured": 100_000, "tiny": SMALL})
    profiles = {"flat": {0.001: 0.46, 0.01: 0.45, 0.1: 0.30},
                "steep": {0.001: 0.95, 0.01: 0.50, 0.1: 0.10}}
    feed(run, 0, profiles=profiles)
    plan = policy.decide(run).plan
    assert ratio_of(plan, "flat") == 0.001
    assert ratio_of(plan, "steep") == 0.01
    assert ratio_of(plan, "unmeasured") == 0.01 and plan.spec_for("tiny") == DENSE
    d = policy.details()
    assert d["achieved_error"] <= d["budget"]
    assert d["predicted_bytes"] < d["reference_bytes"]
    assert d["budget"] == pytest.approx(1.1 * (0.45**2 + 0.5**2))
    # not due again before every_steps, even if the profiles change
    feed(run, 3, profiles={"flat": profiles["steep"], "steep": profiles["flat"]})
    assert policy.decide(run).plan == plan
    feed(run, 5, profiles={"flat": profiles["steep"], "steep": profiles["flat"]})
    plan = policy.decide(run).plan
    assert (ratio_of(plan, "flat"), ratio_of(plan, "steep")) == (0.01, 0.001)


@pytest.mark.parametrize("seed", range(5))
def test_error_budget_never_exceeds_budget(seed: int) -> None:
    rng = random.Random(seed)
    ratios = [0.001, 0.003, 0.01, 0.03, 0.1]
    names = {f"l{i}": rng.choice([2_000, 50_000, 1_000_000]) for i in range(6)}
    run = new_run(names)
    profiles = {}
    for name in names:
        errs = sorted((rng.uniform(0.05, 1.0) for _ in ratios), reverse=True)  # falls with r
        profiles[name] = dict(zip(ratios, errs, strict=True))
    feed(run, 0, {n: rng.uniform(0.1, 10) for n in names}, profiles=profiles)
    policy = ErrorBudgetPolicy(typed("error_budget", slack=rng.choice([0.0, 0.2])))
    plan = policy.decide(run).plan
    d = policy.details()
    assert d["measured_layers"] == 6
    achieved = sum((profiles[n][ratio_of(plan, n)] * run.layers[n].grad_norm[-1][1]) ** 2 for n in names)
    assert achieved == pytest.approx(d["achieved_error"]) and achieved <= d["budget"] * (1 + 1e-12)
    assert d["predicted_bytes"] <= d["reference_bytes"]


def test_error_budget_without_measurements_keeps_reference() -> None:
    policy = ErrorBudgetPolicy(typed("error_budget"))
    run = new_run({"a": BIG})
    feed(run, 0)
    assert ratio_of(policy.decide(run).plan, "a") == 0.01
    feed(run, 1, profiles={"a": {r: 0.0 for r in policy.ratios}})  # solves again at once
    assert ratio_of(policy.decide(run).plan, "a") == 0.001


def test_error_budget_partial_profiles() -> None:
    policy = ErrorBudgetPolicy(typed("error_budget", every_steps=1))
    run = new_run({"a": BIG, "b": BIG})
    # a lacks the reference ratio: kept at it; b chooses among what was measured
    feed(run, 0, profiles={"a": {0.001: 0.0, 0.1: 0.0}, "b": {0.01: 0.5, 0.03: 0.5, 0.1: 0.1}})
    plan = policy.decide(run).plan
    assert (ratio_of(plan, "a"), ratio_of(plan, "b")) == (0.01, 0.01)
    assert policy.details()["measured_layers"] == 1
    run.layers["b"].topk_errors = {"0.01": float("nan"), "x": 0.1, "0.1": 0.2}  # junk is skipped
    run.step = 1
    assert ratio_of(policy.decide(run).plan, "b") == 0.01 and policy.details()["measured_layers"] == 0


# --- bandwidth -------------------------------------------------------------------------------
DENSE_PER_STEP = 1e6  # bytes per rank per step


def feed_timing(run: RunState, step: int, comm: float, compute: float) -> None:
    """Dense traffic: each rank's running totals grow by DENSE_PER_STEP per step."""
    total = DENSE_PER_STEP * step
    feed(run, step, wire=total, dense=total, comm=comm, compute=compute)


def test_bandwidth_dense_when_cheap_strong_when_comm_dominates() -> None:
    policy = make_policy("bandwidth", options("bandwidth"), gate=False)
    run = new_run({"a": BIG, "tiny": SMALL}, interval_steps=10)
    feed_timing(run, 10, comm=0.001, compute=0.1)
    assert policy.decide(run) is None  # one timing: no estimate yet
    feed_timing(run, 20, comm=0.001, compute=0.1)  # 1 GB/s: 1 ms dense < 100 ms compute
    plan = policy.decide(run).plan
    assert plan.default == DENSE and not plan.layers
    assert policy.details()["bandwidth"] == pytest.approx(1e9)

    policy = BandwidthPolicy(typed("bandwidth"))
    run = new_run({"a": BIG, "tiny": SMALL}, interval_steps=10)
    feed_timing(run, 10, comm=1.0, compute=0.01)
    feed_timing(run, 20, comm=1.0, compute=0.01)  # 1 MB/s: t(r) = 2 r s <= 10 ms -> r <= 0.005
    plan = policy.decide(run).plan
    assert ratio_of(plan, "a") == 0.003 and plan.spec_for("tiny") == DENSE
    feed_timing(run, 30, comm=100.0, compute=0.01)  # nothing fits: the smallest ratio
    policy.decide(run)
    feed_timing(run, 40, comm=100.0, compute=0.01)
    assert ratio_of(policy.decide(run).plan, "a") == 0.001


def test_bandwidth_world_size_scales_topk_cost() -> None:
    policy = BandwidthPolicy(typed("bandwidth"))
    run = new_run({"a": BIG}, world_size=4, interval_steps=10)
    feed_timing(run, 10, comm=1.0, compute=0.01)
    feed_timing(run, 20, comm=1.0, compute=0.01)  # t(r) = 4 r s <= 10 ms -> r <= 0.0025
    assert ratio_of(policy.decide(run).plan, "a") == 0.001


def test_bandwidth_hysteresis() -> None:
    policy = BandwidthPolicy(typed("bandwidth"))
    run = new_run({"a": BIG}, interval_steps=10)
    feed_timing(run, 10, comm=0.001, compute=0.1)
    cheap, costly = (0.001, 0.1), (1.0, 0.01)
    ratios = []
    for step, (comm, compute) in zip(range(20, 90, 10), [cheap, costly, cheap, costly, costly, costly, cheap], strict=True):
        feed_timing(run, step, comm, compute)
        ratios.append(ratio_of(policy.decide(run).plan, "a"))
    # a single costly interval does not switch; two in a row do; one cheap one does not go back
    assert ratios == [None, None, None, None, 0.003, 0.003, 0.003]
    assert policy.details()["switches"] == 1
    assert [h[1] for h in policy.details()["history"]][-3:] == [0.003, 0.003, 1.0]


def test_bandwidth_single_worker_has_nothing_to_save() -> None:
    policy = BandwidthPolicy(typed("bandwidth"))
    run = new_run({"a": BIG}, world_size=1, interval_steps=10)
    feed(run, 10, comm=0.0)
    feed(run, 20, comm=0.0)
    assert policy.decide(run).plan == Plan(reason="bandwidth: ratio 1")


# --- guard -----------------------------------------------------------------------------------
def test_guard_returns_dense_while_workers_fall_back() -> None:
    policy = make_policy("static", options("static"))
    assert isinstance(policy, FallbackGate) and policy.name == "static"
    run = new_run({"a": BIG})
    feed(run, 0)
    assert policy.decide(run).plan.default.name == "topk"
    feed(run, 1, fallback=True)
    plan = policy.decide(run).plan
    assert plan.dense and plan.spec_for("a") == DENSE and "fallback" in plan.reason
    feed(run, 2)
    assert policy.decide(run).plan.default.name == "topk"
    assert policy.details()["guard_suppressed_decisions"] == 1


def test_guard_republishes_inner_plan_when_inner_keeps_it() -> None:
    policy = FallbackGate(BandwidthPolicy(typed("bandwidth")))
    run = new_run({"a": BIG}, interval_steps=10)
    assert policy.decide(run) is None  # nothing measured, nothing decided
    feed_timing(run, 10, comm=1.0, compute=0.01)
    feed_timing(run, 20, comm=1.0, compute=0.01)
    compressed = policy.decide(run).plan
    run.timings.clear()  # inner policy has no estimate and returns its current plan
    run.fallback_active = True
    assert policy.decide(run).plan.dense
    run.fallback_active = False
    assert policy.decide(run).plan == compressed


# --- registry --------------------------------------------------------------------------------
def test_make_policy_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"^compression.policy: unknown name 'x'; allowed: static, schedule, "
                                         r"critical, error_budget, bandwidth, adaptive, or an import path"):
        make_policy("x", {})
    assert not isinstance(make_policy("static", options("static"), gate=False), FallbackGate)


# --- snapshots -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_state_dict_is_json_and_round_trips(name: str) -> None:
    overrides = {"critical": {"window_steps": 20}, "error_budget": {"every_steps": 20}}.get(name, {})
    opts = options(name, **overrides)
    run = new_run({"a": 100_000, "b": 50_000, "tiny": SMALL}, interval_steps=10)
    ratios = [0.001, 0.003, 0.01, 0.03, 0.1]
    policy = make_policy(name, opts)

    def step(s: int) -> None:
        norms = {"a": 1.0 + (s > 40) * 2.0, "b": 1.0}
        profiles = {"a": dict(zip(ratios, [0.9, 0.8, 0.5, 0.3, 0.1], strict=True)),
                    "b": dict(zip(ratios, [0.5, 0.45, 0.4, 0.3, 0.2], strict=True))}
        comm = 1.0 if s % 20 else 0.001
        feed(run, s, norms, profiles=profiles, wire=1e6 * s, dense=1e6 * s, comm=comm,
             compute=0.01, fallback=s == 50)

    for s in range(10, 60, 10):
        step(s)
        policy.decide(run)
    state = json.loads(json.dumps(policy.state_dict()))
    json.dumps(policy.details())
    fresh = make_policy(name, opts)
    fresh.load_state_dict(state)
    for s in range(60, 110, 10):
        step(s)
        assert fresh.decide(run) == policy.decide(run), s
    assert fresh.state_dict() == policy.state_dict()
    empty = make_policy(name, opts)
    before = empty.state_dict()
    empty.load_state_dict({})  # what the service passes when a snapshot has no policy state
    assert empty.state_dict() == before
