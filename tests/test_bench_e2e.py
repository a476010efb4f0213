"""The analysis of the end-to-end benchmark (``jobs/bench/e2e/``) on synthetic traces:
time to target (two consecutive evaluations), the training clock without evaluation pauses,
medians over seeds with misses, PASS/MISS, the per-method overrides and the output schema."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from jobs.bench.e2e import analysis, judge, methods, report, stats, traces
from jobs.config import load_config

REPO = Path(__file__).resolve().parents[1]


# --- time to target ------------------------------------------------------------------------
@pytest.mark.parametrize(("values", "target", "lower", "expected"), [
    ([3.0, 2.0, 2.5, 1.9, 1.8], 2.0, True, 3),  # idx 1 meets once, idx 2 breaks the run
    ([2.0, 2.0], 2.0, True, 0),                  # equality meets; the first of the pair counts
    ([2.5, 2.1, 1.9], 2.0, True, None),           # a hit at the last evaluation is unconfirmed
    ([1.9, 2.1, 1.9, 2.1], 2.0, True, None),      # never twice in a row
    ([], 2.0, True, None),
    ([0.80, 0.90, 0.91, 0.95], 0.90, False, 1),   # accuracy: higher is better
    ([0.95, 0.89, 0.90, 0.90], 0.90, False, 2),
    ([1.0, None, 1.0, 1.0], 2.0, True, 2),        # a missing evaluation breaks the run
    ([1.0, math.nan, 1.0, 1.0], 2.0, True, 2),
])
def test_target_index_two_consecutive(values, target, lower, expected):
    assert traces.target_index(values, target, lower) == expected


def test_target_index_other_run_lengths():
    assert traces.target_index([1, 1, 3, 1, 1, 1], 2.0, True, consecutive=3) == 3
    assert traces.target_index([3, 1], 2.0, True, consecutive=1) == 1


def _steps(n: int, pauses: dict[int, float] | None = None, step_s: float = 1.0, t0: float = 100.0):
    """Step records: step i ends at t0 + (i + 1) * step_s, plus the pauses before it."""
    out, extra = [], 0.0
    for i in range(n):
        extra += (pauses or {}).get(i, 0.0)
        out.append({"step": i, "time": t0 + (i + 1) * step_s + extra, "wire_bytes": 0, "dense_bytes": 0})
    return out


def test_training_clock_uses_the_record_before_the_evaluation_and_drops_pauses():
    # evaluations after 10 and 20 steps, 5 s and 7 s long (they sit before records 10 and 20)
    steps = _steps(30, {10: 5.0, 20: 7.0})
    clock = traces.training_clock(steps, [10, 20, 30])
    assert clock[1] == 0.0  # the clock starts at the end of step 0
    assert clock[10] == pytest.approx(9.0)  # record 9: nine 1-s steps after step 0, no pause yet
    assert clock[11] == pytest.approx(10.0)  # the 5-s evaluation is not training time
    assert clock[20] == pytest.approx(19.0)
    assert clock[21] == pytest.approx(20.0)
    assert clock[30] == pytest.approx(29.0)
    assert 31 not in clock
    # without the evaluation steps the pauses count
    assert traces.training_clock(steps, [])[21] == pytest.approx(32.0)
    assert traces.training_clock([], [10]) == {}


def test_steady_step_time_excludes_evaluation_gaps():
    steps = _steps(30, {10: 5.0, 20: 7.0}, step_s=0.5)
    seconds, n = traces.steady_step_s(steps, [10, 20], start=5)
    assert seconds == pytest.approx(0.5) and n == 25 - 2  # gaps 5..29 minus the two with evaluations
    seconds, n = traces.steady_step_s(steps, [], start=5)
    assert seconds == pytest.approx((25 * 0.5 + 12) / 25)


def test_first_compressed_step_from_the_ledger():
    steps = [{"step": i, "wire_bytes": 100 * min(i + 1, 3) + (i >= 3) * 5 * (i - 2),
              "dense_bytes": 100 * (i + 1)} for i in range(6)]
    assert traces.first_compressed_step(steps) == 3
    assert traces.first_compressed_step([{"step": i, "wire_bytes": 10 * (i + 1), "dense_bytes": 10 * (i + 1)}
                                      for i in range(4)]) is None


# --- seeds ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("values", "median"), [
    ([10.0, 12.0, 11.0], 11.0),
    ([10.0, None, 12.0], 12.0),  # a miss is infinitely slow: the median is the slower hit
    ([10.0, None, None], None),  # most seeds missed
    ([10.0, 20.0], 15.0),
    ([10.0, None], None),
    ([], None),
])
def test_median_with_misses(values, median):
    assert stats.median_with_misses(values) == median


def test_spread():
    assert stats.spread([12.0, 10.0, 11.0]) == [10.0, 12.0]
    assert stats.spread([12.0, None, 11.0]) == [11.0, None]
    assert stats.spread([None, None]) == [None, None]


# --- PASS / MISS -----------------------------------------------------------------------------
def _row(name, t, final=2.0, nic=1e6, step=0.3, control=0.005):
    return {"name": name, "time_to_target_s": t, "final_metric": final, "nic_bytes_per_step": nic,
            "step_s": step, "control_share": control}


def _results(rows, workload="gpt", rate="100mbit", compute=0.25):
    return {"workload": {"name": workload}, "link": {"rate": rate}, "compute_step_s": compute,
            "target": {"metric": "loss", "lower_is_better": True}, "methods": rows}


def _verdicts(results):
    return [g["ok"] for g in judge.judge(results)]


def test_gpt_goals_pass_at_their_boundaries():
    rows = [_row("dense", 420.0, final=100.0, nic=50.0 * 1024), _row("torch_powersgd_r1", 130.0),
            _row("torch_powersgd_r2", 126.0), _row("raycomp_topk", 80.0),
            _row("raycomp_adaptive", 84.0, final=101.0, nic=1024.0, step=0.3, control=0.01)]
    results = _results(rows, compute=0.25)
    goals = judge.judge(results)
    assert [g["value"] for g in goals] == [5.0, 1.5, 1.05, 0.01, 50.0, 1.2, 0.01]
    assert _verdicts(results) == [True, True, True, True, True, True, True]
    assert "raycomp_topk" in goals[2]["goal"]


def test_gpt_goals_miss_just_past_their_boundaries():
    rows = [_row("dense", 419.9, final=100.0, nic=49.9 * 1024), _row("torch_powersgd_r4", 125.9),
            _row("raycomp_int8", 79.9), _row("raycomp_adaptive", 84.0, final=101.01, nic=1024.0,
                                             step=0.3001, control=0.0101)]
    assert _verdicts(_results(rows, compute=0.25)) == [False] * 7


def test_the_step_goal_divides_by_the_no_communication_step_when_the_report_has_one():
    rows = [_row("dense", 420.0), _row("raycomp_adaptive", 84.0, step=0.3)]
    rows[-1]["step_vs_no_comm"] = 1.2
    results = {**_results(rows, compute=0.2), "no_comm_step_s": 0.25}
    goal = judge.judge(results)[5]
    assert "noop_hook" in goal["goal"] and goal["value"] == 1.2 and goal["ok"]  # 0.3 / 0.2 = 1.5 would MISS
    rows[-1]["step_vs_no_comm"] = 1.2001
    assert not judge.judge(results)[5]["ok"]
    rows[-1]["step_vs_no_comm"] = None  # no seed had both: a missing number
    assert not judge.judge(results)[5]["ok"]


def test_a_missing_number_is_a_miss():
    rows = [_row("dense", None), _row("raycomp_adaptive", None, final=None, nic=None, step=None, control=None)]
    goals = judge.judge(_results(rows))
    assert len(goals) == 7 and not any(g["ok"] for g in goals)
    assert judge.judge(_results([_row("dense", 1.0)])) == []  # no adaptive run: nothing to judge


def test_torch_powersgd_that_never_reaches_the_target_counts_as_infinitely_slow():
    rows = [_row("dense", 420.0), _row("torch_powersgd_r1", None), _row("torch_powersgd_r4", None),
            _row("raycomp_adaptive", 84.0)]
    goal = judge.judge(_results(rows))[1]
    assert goal["ok"] and goal["value"] is None
    assert goal["note"].startswith("none of the 2 torch powerSGD ranks run reached the target")
    rows[-1]["time_to_target_s"] = None  # adaptive missed too: no verdict in its favour
    assert not judge.judge(_results(rows))[1]["ok"]
    rows[1]["time_to_target_s"] = 100.0  # one rank reached it: the ratio decides
    rows[-1]["time_to_target_s"] = 84.0
    assert judge.judge(_results(rows))[1] == {**judge.judge(_results(rows))[1], "value": pytest.approx(100 / 84),
                                            "ok": False}


def test_the_shared_dense_warmup_caps_what_the_dense_and_nic_goals_can_reach():
    # the transformer at 100 Mbit/s as measured (e2e-gpt-100mbit.json): 160 steps, 20 dense
    dense = {**_row("dense", 193.1, step=1.389), "steps_to_target_seeds": [140, 120, 140]}
    rows = [dense, _row("raycomp_adaptive", 117.8)]
    results = {**_results(rows, compute=0.26), "workload": {"name": "gpt", "steps": 160, "warmup_steps": 20}}
    ceilings = judge.warmup_ceilings(results, dense)
    # NIC: steps 1-19 of the counted 1-159 send dense's bytes whatever comes after
    assert ceilings["nic"] == pytest.approx(159 / 19)
    # time: 19 dense steps of 1.389 s, then 121 compute-only steps of 0.26 s to dense's step 140
    assert ceilings["vs_dense"] == pytest.approx(193.1 / 57.851)
    goals = judge.judge(results)
    assert [g.get("ceiling") for g in goals] == [ceilings["vs_dense"], None, None, None, ceilings["nic"], None, None]
    # two workers without communication are slower than one alone: the ceiling uses them
    no_comm = judge.warmup_ceilings({**results, "no_comm_step_s": 0.3}, dense)["vs_dense"]
    assert no_comm == pytest.approx(193.1 / (19 * 1.389 + 121 * 0.3))
    dense["steps_to_target_seeds"] = [140, None, None]  # dense itself missed: no step to reach
    assert judge.warmup_ceilings(results, dense)["vs_dense"] is None
    assert judge.warmup_ceilings({**results, "workload": {"name": "gpt"}}, dense) == {"nic": None, "vs_dense": None}


def test_fast_link_and_cnn_goals():
    rows = [_row("dense", 100.0), _row("torch_bf16", 90.0), _row("raycomp_adaptive", 94.5)]
    fast = judge.judge(_results(rows, rate="fast"))
    assert len(fast) == 1 and fast[0]["ok"] and fast[0]["value"] == pytest.approx(1.05)
    rows[-1]["time_to_target_s"] = 94.6
    assert not judge.judge(_results(rows, rate="fast"))[0]["ok"]
    cnn = [_row("raycomp_topk", 50.0), _row("raycomp_adaptive", 50.0)]
    assert _verdicts(_results(cnn, workload="cnn")) == [True]
    cnn[-1]["time_to_target_s"] = 50.5
    assert _verdicts(_results(cnn, workload="cnn")) == [False]


def test_other_workloads_judge_the_final_loss_against_dense_when_dense_ran():
    rows = [_row("dense", 120.0, final=2.0), _row("raycomp_int4", 60.0, final=2.0),
            _row("raycomp_adaptive", 60.0, final=2.019)]
    goals = judge.judge(_results(rows, workload="lstm"))
    assert [g["ok"] for g in goals] == [True, True]
    assert goals[1]["value"] == pytest.approx(0.0095) and "within 1% of dense" in goals[1]["goal"]
    rows[-1]["final_metric"] = 2.0201
    assert _verdicts(_results(rows, workload="lstm")) == [True, False]
    rows[-1]["final_metric"] = None  # no number: a MISS
    assert _verdicts(_results(rows, workload="lstm")) == [True, False]


def test_the_goals_table_names_only_known_scopes_measures_comparisons_and_ceilings():
    from jobs.bench.e2e.goals import GOALS, SCOPES

    scopes = [name for name, _ in SCOPES]
    assert SCOPES[-1][1] == {}  # the last scope takes any report the others leave
    for goal in GOALS:
        assert goal.scope in scopes and goal.measure in judge.MEASURES, goal
        assert goal.comparison in judge.COMPARISONS, goal
        assert (goal.threshold is None) == (goal.comparison == "present"), goal
        assert goal.ceiling in (None, "nic", "vs_dense"), goal
    assert {g.scope for g in GOALS} == set(scopes)
    # FSDP is judged by its own goals whatever the link; the fast link by its one goal whatever the workload
    rows = [_row("dense", 300.0), _row("raycomp_adaptive", 240.0)]
    assert judge.scope_of({**_results(rows, rate="fast"), "strategy": "fsdp"}) == "fsdp"
    assert judge.scope_of(_results(rows, workload="cnn", rate="fast")) == "fast link"
    assert judge.scope_of(_results(rows, workload="cnn")) == "other workloads"


# --- fairness of the runs ----------------------------------------------------------------------
def test_every_method_gets_the_same_budget_seed_cadence_and_warmup():
    settings = {"extra": [], "steps": 240, "eval_every": 20, "warmup": 20, "stop_at_target": False,
                "target": None}
    shared = None
    for name in [*methods.METHODS, methods.COMPUTE, methods.NO_COMM]:
        overrides = methods.method_overrides(name, settings, seed=1, interval=10, bucket_cap_mb=16.0)
        config = load_config(REPO / "jobs/configs/gpt_kjv.yaml", overrides)
        w, c, b = config.workload, config.compression, config.benchmark
        assert (config.run.seed, w.steps_per_epoch * w.epochs, w.eval_every_steps) == (1, 240, 20), name
        assert (w.lr, w.lr_schedule, w.batch_size) == (0.002, "cosine", 6)
        assert b.warmup_steps == b.powersgd_start_iter == 20
        assert config.scaling.num_workers == (1 if name == methods.COMPUTE else 2), name
        assert (b.baseline == "torch_noop") == (name == methods.NO_COMM), name
        if name == methods.COMPUTE:
            continue
        assert c.warmup_steps == 10  # + the control interval: the first compressed plan at step 20
        assert (b.bucket_cap_mb is not None) == name.startswith("torch_powersgd")
        if name.startswith("torch_powersgd"):
            assert b.powersgd_rank == int(name[-1])
        key = (w.model_dump(), c.warmup_steps)
        shared = shared or key
        assert key == shared, name
    stop = methods.method_overrides("dense", {**settings, "stop_at_target": True, "target": 1.9}, 0, 10, 16.0)
    config = load_config(REPO / "jobs/configs/gpt_kjv.yaml", stop)
    assert (config.workload.stop_at_target, config.workload.stop_consecutive) == (1.9, 2)


def test_the_lstm_workload_runs_its_own_config_at_the_benchmark_budget():
    spec = methods.WORKLOADS["lstm"]
    settings = {"extra": spec.get("overrides", []), "steps": spec["full"]["steps"],
                "eval_every": spec["full"]["eval_every"], "warmup": spec["warmup"],
                "stop_at_target": False, "target": None}
    for name in ("dense", "torch_powersgd_r4", "raycomp_adaptive"):
        config = load_config(REPO / spec["config"], methods.method_overrides(name, settings, 0, 10, 16.0))
        w = config.workload
        assert (w.model, w.optimizer, w.steps_per_epoch * w.epochs, w.eval_every_steps) == ("lstm", "sgd", 200, 20)
        assert config.benchmark.warmup_steps == 20


def test_fsdp_methods_share_the_budget_and_differ_only_in_the_reduce_scatter():
    settings = {"extra": [], "steps": 160, "eval_every": 20, "warmup": 20, "stop_at_target": False,
                "target": None, "strategy": "fsdp"}
    seen = {}
    for name in methods.FSDP_METHODS:
        config = load_config(REPO / "jobs/configs/gpt_kjv.yaml", methods.method_overrides(name, settings, 2, 10, 16.0))
        w, c = config.workload, config.compression
        assert config.scaling.strategy == "fsdp", name
        assert (config.run.seed, w.steps_per_epoch * w.epochs, w.eval_every_steps, c.warmup_steps) == (2, 160, 20, 10)
        seen[name] = (config.benchmark.baseline, c.policy, c.static.compressor.name if c.policy == "static" else None)
    assert seen == {"dense": ("torch_fsdp", "static", "none"), "torch_bf16": ("torch_fsdp_bf16", "static", "none"),
                    "raycomp_bf16": ("none", "static", "bf16"), "raycomp_int8": ("none", "static", "int8"),
                    "raycomp_adaptive": ("none", "adaptive", None)}
    with pytest.raises(SystemExit, match="allowed with --strategy fsdp: dense, torch_bf16, raycomp_bf16"):
        methods.parse_methods("raycomp_topk", quick=False, strategy="fsdp")


def test_fsdp_goals_and_report_names():
    rows = [_row("dense", 300.0, nic=20e6), _row("torch_bf16", 250.0), _row("raycomp_adaptive", 240.0, nic=14e6)]
    results = {**_results(rows), "strategy": "fsdp"}
    goals = judge.judge(results)
    assert [g["value"] for g in goals] == [pytest.approx(1.25), pytest.approx(20 / 14), pytest.approx(0.96)]
    assert [g["ok"] for g in goals] == [True, True, True] and "FSDP" in goals[0]["goal"]
    rows[-1].update(time_to_target_s=None, nic_bytes_per_step=21e6)
    assert [g["ok"] for g in judge.judge(results)] == [False, False, False]
    assert report.report_stem({**results, "link": {"rate": "100mbit"}}) == "fsdp-gpt-100mbit"
    assert report.modeled(results, "dense") and not report.modeled(results, "raycomp_int8")
    assert not report.modeled(results, "torch_powersgd_r1")


# --- schema ---------------------------------------------------------------------------------
def _raw_run(method, seed, values, step_s, wire_per_step, every=10):
    n = every * len(values)
    steps = _steps(n, {s: 3.0 for s in range(every, n, every)}, step_s=step_s)
    for i, r in enumerate(steps):
        r["dense_bytes"] = 800.0 * (i + 1)
        r["wire_bytes"] = 800.0 * min(i + 1, 20) + wire_per_step * max(0, i + 1 - 20)
        r["loss"] = 1.0
    evals = [{"time": steps[every * (k + 1) - 1]["time"] + 2.0, "step": every * (k + 1), "epoch": k,
              "eval_loss": v} for k, v in enumerate(values)]
    evals.append(dict(evals[-1]))  # a loop that evaluates at eval_every_steps and at epoch ends
    nic = [[steps[0]["time"] - 1, 0, 0], [steps[-1]["time"] + 1, 1000 * n, 1000 * n]]
    return {"method": method, "seed": seed, "summary": {"status": "succeeded", "steps": n,
                                                         "control_overhead": 0.004},
            "t_start": steps[0]["time"] - 10, "t_end": steps[-1]["time"] + 5, "nic": nic,
            "evals": evals, "steps": steps, "controller_cpu_s": 0.1, "placement": {"rank0": "a", "rank1": "b"}}


def test_analyze_writes_the_documented_schema(tmp_path):
    settings = {"workload": "gpt", "config": "jobs/configs/gpt_kjv.yaml", "mode": "quick", "steps": 40,
                "eval_every": 10, "seeds": [0, 1], "target": None, "warmup": 20, "link": "100mbit",
                "stop_at_target": False}
    raw = {"layers": {"w": [100, 2], "b": [2]}, "metric": "loss", "interval_steps": 10, "bucket_cap_mb": 1.0,
           "default_policy": "critical", "idle": [{"seconds": 10.0, "tx_bytes": 50, "rx_bytes": 50}],
           "runs": [_raw_run(methods.COMPUTE, 0, [3.0, 3.0], 0.15, 0.0),
                    _raw_run(methods.NO_COMM, 0, [3.0, 3.0], 0.25, 0.0),
                    _raw_run("dense", 0, [3.0, 2.6, 2.4, 2.3], 1.0, 800.0),
                    _raw_run("raycomp_adaptive", 0, [3.0, 2.5, 2.45, 2.4], 0.3, 8.0),
                    _raw_run(methods.NO_COMM, 1, [3.0, 3.0], 0.2, 0.0),
                    _raw_run("dense", 1, [3.0, 2.7, 2.5, 2.3], 1.0, 800.0),
                    _raw_run("raycomp_adaptive", 1, [3.0, 2.6, 2.6, 2.6], 0.4, 8.0)]}
    check = {"a_to_b": {"bits_per_s": 95.7e6}, "b_to_a": {"bits_per_s": 95.6e6}, "rtt": {"median_s": 2e-5}}
    shaping = {"qdisc": {"a": "tbf rate 100000000bit"}, "rate": "100mbit"}
    results = analysis.analyze(raw, settings, shaping, check)
    assert set(results) >= {"workload", "link", "target", "seeds", "compute_step_s", "methods", "goals"}
    assert results["workload"]["name"] == "gpt" and results["workload"]["parameters"] == 202
    assert results["link"] == {**results["link"], "rate": "100mbit", "measured_mbit_s": 95.6}
    # auto target: dense's median at the first evaluation at or after 3/4 of 40 steps (step 30)
    assert results["target"] == {**results["target"], "metric": "loss", "value": 2.45, "lower_is_better": True}
    assert results["compute_step_s"] == pytest.approx(0.15)
    # each seed's step over the no-communication step of its own group: 0.3 / 0.25 and 0.4 / 0.2
    # (not 1.5 and 1.6 with the seeds crossed, nor 0.35 / 0.225 from the medians)
    assert results["no_comm_step_s"] == pytest.approx(0.225)
    assert results["no_comm_step_s_seeds"] == {"0": pytest.approx(0.25), "1": pytest.approx(0.2)}
    dense, ada = results["methods"]
    assert [m["name"] for m in results["methods"]] == ["dense", "raycomp_adaptive"]
    required = {"name", "time_to_target_s", "time_to_target_s_seeds", "final_metric", "wire_bytes",
                "nic_bytes", "step_s", "control_share"}
    assert required <= set(dense)
    # dense seed 0: 2.4 @30 and 2.3 @40 -> hit at step 30 = 29 one-second steps after step 0
    # dense seed 1: 2.5 @30 misses, 2.3 @40 is the last evaluation -> unconfirmed
    assert dense["time_to_target_s_seeds"] == [pytest.approx(29.0), None]
    assert dense["time_to_target_s"] is None  # median of [29, miss] is a miss
    assert ada["time_to_target_s_seeds"] == [pytest.approx(0.3 * 29), None]
    assert ada["final_metric"] == pytest.approx(2.5) and ada["first_compressed_step_seeds"] == [20, 20]
    assert dense["wire_bytes"] == pytest.approx(2 * 4 * 202 * 40)  # the byte model of allreduce_hook
    assert ada["step_s"] == pytest.approx(0.35) and ada["control_share"] == pytest.approx(0.004)
    assert ada["step_vs_no_comm"] == pytest.approx((1.2 + 2.0) / 2)
    step_goal = next(g for g in results["goals"] if g["goal"].startswith("adaptive steady step time"))
    assert "noop_hook" in step_goal["goal"] and step_goal["value"] == pytest.approx(1.6) and not step_goal["ok"]
    json.dumps(results, allow_nan=False)
    paths = report.write_reports({**results, "command": "python -m jobs.bench e2e --quick"}, tmp_path)
    assert [p.name for p in paths] == ["e2e-gpt-100mbit.json", "e2e-gpt-100mbit.md", "e2e-gpt-100mbit.png"]
    text = paths[1].read_text()
    assert "MISS" in text and "raycomp_adaptive" in text
    assert "| step / no-comm |" in text and "**250 / 200 ms** (seeds 0, 1)" in text
    # 40 steps, 20 of them the shared dense warm-up: NIC bytes can fall at most 39/19 = 2.05x
    assert "fewer than dense: **" in text and "MISS** (ceiling under this benchmark's shared dense warm-up: 2.05x)" in text
    assert json.loads(paths[0].read_text())["methods"][1]["name"] == "raycomp_adaptive"
    # FSDP: dense's bytes are an ideal fp32 reduce-scatter's, half an all-reduce's
    sharded = analysis.analyze(raw, {**settings, "strategy": "fsdp"}, shaping, check)
    assert sharded["strategy"] == "fsdp"
    assert sharded["methods"][0]["wire_bytes"] == pytest.approx(2 * 4 * 202 * 40 / 2)
    assert "FSDP2" in report.render_markdown({**sharded, "command": "x"})


def test_a_run_stopped_early_reports_the_seeds_that_ran(tmp_path):
    settings = {"workload": "gpt", "config": "jobs/configs/gpt_kjv.yaml", "mode": "full", "steps": 40,
                "eval_every": 10, "seeds": [0, 1, 2], "target": None, "warmup": 20, "link": "100mbit",
                "stop_at_target": False}
    raw = {"layers": {"w": [100, 2]}, "metric": "loss", "interval_steps": 10, "bucket_cap_mb": 1.0,
           "default_policy": "adaptive", "idle": [],
           "runs": [_raw_run("dense", 0, [3.0, 2.6, 2.4, 2.3], 1.0, 800.0),
                    _raw_run("dense", 1, [3.0, 2.7, 2.5, 2.3], 1.0, 800.0),
                    _raw_run("raycomp_adaptive", 0, [3.0, 2.5, 2.45, 2.4], 0.3, 8.0)]}  # stopped here
    check = {"a_to_b": {"bits_per_s": 95.7e6}, "b_to_a": {"bits_per_s": 95.6e6}, "rtt": {"median_s": 2e-5}}
    results = analysis.analyze(raw, settings, {"qdisc": {"a": "tbf"}, "rate": "100mbit"}, check)
    assert results["seeds"] == [0, 1] and results["seeds_requested"] == [0, 1, 2]
    assert results["methods"][1]["time_to_target_s_seeds"] == [pytest.approx(0.3 * 29)]
    text = report.render_markdown({**results, "command": "x"})
    assert "over a 100mbit link, 2 seeds" in text
    assert "**Stopped early: 2 of the 3 requested seeds (0, 1, 2) ran**" in text


# --- a tiny real run ------------------------------------------------------------------------------
def _root_with_netns() -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


@pytest.mark.benchmark  # two Ray nodes over a throttled veth: minutes; `pytest -m benchmark`
@pytest.mark.skipif(not _root_with_netns(), reason="needs root and iproute2 (network namespaces)")
def test_tiny_real_run_over_the_throttled_link(tmp_path):
    """2 Ray nodes in namespaces, the digits MLP, dense and raycomp Top-K, 44 steps each."""
    import os
    import subprocess
    import sys

    from jobs.bench.netns import NS_PREFIX, namespaces

    before = {n for n in namespaces() if n.startswith(NS_PREFIX)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "jobs.bench", "e2e", "--quick", "--workload", "mlp", "--methods",
         "dense,raycomp_topk", "--steps", "44", "--eval-every", "22", "--output-dir", str(tmp_path),
         "--work-dir", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "e2e-mlp-100mbit.json").read_text())
    assert [m["name"] for m in results["methods"]] == ["dense", "raycomp_topk"]
    assert results["link"]["measured_mbit_s"] == pytest.approx(95, abs=10)
    assert results["compute_step_s"] > 0
    for m in results["methods"]:
        assert m["status_seeds"] == ["succeeded"] and m["steps_seeds"] == [44], m["errors"]
        assert [p["step"] for p in m["runs"][0]["curve"]] == [22, 44]
        assert m["nic_bytes"] > 0.9 * m["wire_bytes"] > 0
    dense, topk = results["methods"]
    assert topk["first_compressed_step_seeds"] == [20]  # the shared dense warm-up
    # 20 of 44 steps dense (the warm-up), then Top-1% (values + indices, all-gathered)
    assert 20 / 44 <= topk["wire_bytes"] / dense["wire_bytes"] < 20 / 44 + 0.05
    assert {n for n in namespaces() if n.startswith(NS_PREFIX)} <= before  # torn down


# --- torch's hooks as the benchmark configures them (jobs/baselines.py) -----------------------
def _torch_hook_steps(rank: int, world: int, hook: str, warmup: int) -> list[tuple[Any, Any]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from jobs.baselines import ddp_options, one_bucket_cap_mb, register_torch_hook
    from jobs.config import BenchmarkSection
    from raycomp.config import CompressionSection

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    benchmark = BenchmarkSection(baseline=hook, warmup_steps=warmup, powersgd_start_iter=max(2, warmup),
                                 powersgd_rank=1, bucket_cap_mb=one_bucket_cap_mb(model))
    ddp = DDP(model, **ddp_options(benchmark, CompressionSection(), model))
    register_torch_hook(ddp, benchmark)
    out = []
    for step in range(4):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        local = [p.grad.clone() for p in model.parameters()]  # already reduced by the hook
        ddp.zero_grad()
        with ddp.no_sync():  # this rank's own gradient, for the fp32 reference mean
            ddp(x).square().mean().backward()
        own = [p.grad.clone() for p in model.parameters()]
        for g in own:
            torch.distributed.all_reduce(g)
            g /= world
        out.append((local, own))
    return out


@pytest.mark.parametrize("hook", ["torch_fp16", "torch_bf16"])
def test_cast_hooks_all_reduce_fp32_during_the_shared_warmup(hook):
    import torch

    from tests.distributed import run_distributed

    ranks = run_distributed(_torch_hook_steps, 2, hook, 2)
    dtype = torch.float16 if hook == "torch_fp16" else torch.bfloat16
    for step, ((got, mean), (got1, _)) in enumerate(zip(ranks[0], ranks[1], strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(got, got1, strict=True))  # ranks agree
        cast = all(torch.equal(g, g.to(dtype).float()) for g in got)
        if step < 2:  # the dense warm-up: exactly the fp32 mean, not representable in the cast
            assert all(torch.allclose(g, m, rtol=1e-6, atol=1e-9) for g, m in zip(got, mean, strict=True))
            assert not cast
        else:
            assert cast
            assert all(torch.allclose(g, m, rtol=2e-2, atol=1e-3) for g, m in zip(got, mean, strict=True))


def test_torch_noop_hook_leaves_each_rank_its_own_gradient():
    import torch

    from tests.distributed import run_distributed

    ranks = run_distributed(_torch_hook_steps, 2, "torch_noop", 0)
    for (got, mean), (got1, _) in zip(ranks[0], ranks[1], strict=True):
        assert not any(torch.equal(a, b) for a, b in zip(got, got1, strict=True))  # nothing exchanged
        for a, b, m in zip(got, got1, mean, strict=True):  # each kept its own: they average to the mean
            assert torch.allclose((a + b) / 2, m, rtol=1e-5, atol=1e-7)


def test_torch_powersgd_runs_on_gloo_in_one_bucket_after_the_warmup():
    import torch

    from tests.distributed import run_distributed

    ranks = run_distributed(_torch_hook_steps, 2, "torch_powersgd", 2)
    for step, ((got, mean), (got1, _)) in enumerate(zip(ranks[0], ranks[1], strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(got, got1, strict=True))
        weight, bias = got[2], got[3]
        if step < 2:
            assert torch.allclose(weight, mean[2], rtol=1e-5, atol=1e-8)
        else:  # rank 1: the 512x512 weight's gradient is a rank-1 approximation
            assert torch.linalg.matrix_rank(weight).item() == 1
            assert torch.allclose(bias, mean[3], rtol=1e-5, atol=1e-8)  # 1-D: all-reduced densely
