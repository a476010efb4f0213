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
from tests.support.bench_records import raw_run, step_records

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


def test_training_clock_uses_the_record_before_the_evaluation_and_drops_pauses():
    # evaluations after 10 and 20 steps, 5 s and 7 s long (they sit before records 10 and 20)
    steps = step_records(30, {10: 5.0, 20: 7.0})
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
    steps = step_records(30, {10: 5.0, 20: 7.0}, step_s=0.5)
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
def _row(name, t, final=2.0, nic=1e6, step=0.3, control=0.005, steps_to=None):
    """One method's medians; its one seed's curve ends at step 320 with ``final``."""
    runs = [{"seed": 0, "curve": [] if final is None else [{"step": 320, "value": final}]}]
    return {"name": name, "time_to_target_s": t, "final_metric": final, "nic_bytes_to_stop": nic,
            "nic_bytes_per_step": None if nic is None else nic / 100,
            "nic_bytes_per_steady_step": None if nic is None else nic / 100, "step_s": step, "control_share": control,
            "steps_to_target": steps_to, "runs": runs}


def _results(rows, workload="gpt", rate="100mbit", bound=67.2):
    return {"workload": {"name": workload}, "link": {"rate": rate}, "compute_bound_time_to_target_s": bound,
            "target": {"metric": "loss", "lower_is_better": True}, "methods": rows}


def _verdicts(results):
    return [g["ok"] for g in judge.judge(results)]


def test_gpt_goals_pass_at_their_boundaries_with_the_physical_limit_beside_each_ratio():
    rows = [_row("dense", 420.0, final=100.0, nic=50.0 * 1024), _row("torch_bf16", 200.0),
            _row("raycomp_int4", 126.0), _row("torch_postlocalsgd", 100.8), _row("torchft_diloco", 150.0),
            _row("raycomp_adaptive", 84.0, final=101.0, nic=1024.0)]
    goals = judge.judge(_results(rows, bound=84.0 / 1.25))
    assert [g["measure"] for g in goals] == ["speedup_vs_dense", "speedup_vs_int4", "speedup_vs_best_local",
                                             "time_vs_compute_bound", "nic_reduction_vs_dense",
                                             "final_metric_vs_dense"]
    assert [g["value"] for g in goals] == [pytest.approx(v) for v in (5.0, 1.5, 1.2, 1.25, 50.0, 0.01)]
    assert all(g["ok"] for g in goals)
    # the limit: each ratio if adaptive reached the target at the compute-bound time (67.2 s)
    assert [g.get("limit") for g in goals] == [pytest.approx(420 / 67.2), pytest.approx(126 / 67.2),
                                              pytest.approx(100.8 / 67.2), 1.0, None, None]
    assert "(torch_postlocalsgd)" in goals[2]["goal"]  # the fastest local-step method, not DiLoCo


def test_gpt_goals_miss_just_past_their_boundaries():
    rows = [_row("dense", 419.9, final=100.0, nic=49.9 * 1024), _row("raycomp_int4", 125.9),
            _row("raycomp_local", 100.7), _row("raycomp_adaptive", 84.0, final=101.01, nic=1024.0)]
    assert _verdicts(_results(rows, bound=84.0 / 1.2501)) == [False] * 6


def test_a_missing_number_is_a_miss():
    rows = [_row("dense", None), _row("raycomp_int4", 10.0), _row("torch_postlocalsgd", 10.0),
            _row("raycomp_adaptive", None, final=None, nic=None)]
    goals = judge.judge(_results(rows, bound=None))
    assert len(goals) == 6 and not any(g["ok"] for g in goals)
    assert judge.judge(_results([_row("dense", 1.0)])) == []  # no adaptive run: nothing to judge
    # a goal about a method that did not run is not judged
    assert [g["measure"] for g in judge.judge(_results([_row("dense", 1.0), _row("raycomp_adaptive", 1.0)]))] == \
        ["speedup_vs_dense", "time_vs_compute_bound", "nic_reduction_vs_dense", "final_metric_vs_dense"]


def test_local_step_methods_that_never_reach_the_target_count_as_infinitely_slow():
    rows = [_row("dense", 420.0), _row("torch_postlocalsgd", None), _row("torchft_diloco", None),
            _row("raycomp_adaptive", 84.0)]
    goal = judge.judge(_results(rows))[1]
    assert goal["measure"] == "speedup_vs_best_local" and goal["ok"] and goal["value"] is None
    assert goal["note"].startswith("none of the local-step methods run (torch_postlocalsgd, torchft_diloco) reached")
    rows[-1]["time_to_target_s"] = None  # adaptive missed too: no verdict in its favour
    assert not judge.judge(_results(rows))[1]["ok"]
    rows[2]["time_to_target_s"] = 100.0  # DiLoCo reached it: the ratio decides
    rows[-1]["time_to_target_s"] = 84.0
    goal = judge.judge(_results(rows))[1]
    assert (goal["value"], goal["ok"]) == (pytest.approx(100 / 84), False) and "(torchft_diloco)" in goal["goal"]


def test_fast_link_and_cnn_goals():
    rows = [_row("dense", 100.0), _row("torch_bf16", 90.0), _row("raycomp_adaptive", 94.5)]
    fast = judge.judge(_results(rows, rate="fast", bound=80.0))
    assert len(fast) == 1 and fast[0]["ok"] and fast[0]["value"] == pytest.approx(1.05)
    assert fast[0]["limit"] == pytest.approx(80 / 90)
    rows[-1]["time_to_target_s"] = 94.6
    assert not judge.judge(_results(rows, rate="fast"))[0]["ok"]
    # CNN: not slower than the best other method of any kind, a local-step one included
    cnn = [_row("torch_powersgd_r4", 60.0), _row("torch_postlocalsgd", 50.0), _row("raycomp_adaptive", 50.0)]
    goals = judge.judge(_results(cnn, workload="cnn"))
    assert [g["ok"] for g in goals] == [True] and "(torch_postlocalsgd)" in goals[0]["goal"]
    cnn[-1]["time_to_target_s"] = 50.5
    assert _verdicts(_results(cnn, workload="cnn")) == [False]


def test_other_workloads_judge_the_final_loss_against_dense_when_dense_ran():
    rows = [_row("dense", 120.0, final=2.0), _row("raycomp_int4", 60.0, final=2.0),
            _row("raycomp_adaptive", 60.0, final=2.019)]
    goals = judge.judge(_results(rows, workload="lstm"))
    assert [g["ok"] for g in goals] == [True, True]
    assert goals[1]["value"] == pytest.approx(0.0095) and "within 1% of dense's at the same step" in goals[1]["goal"]
    rows[-1] = _row("raycomp_adaptive", 60.0, final=2.0201)
    assert _verdicts(_results(rows, workload="lstm")) == [True, False]
    rows[-1] = _row("raycomp_adaptive", 60.0, final=None)  # no number: a MISS
    assert _verdicts(_results(rows, workload="lstm")) == [True, False]


def test_the_final_loss_is_compared_with_dense_at_the_same_step_per_seed():
    # dense runs its whole budget (the auto target); adaptive stops once the target held:
    # its last evaluation is compared with dense's at that step, on the same seed, not with
    # dense's last (which is lower by dense's own progress after the target step)
    def curve(values):
        return [{"step": 16 * (i + 1), "value": v} for i, v in enumerate(values)]

    dense = _row("dense", 120.0, final=1.80)
    dense["runs"] = [{"seed": 0, "curve": curve([2.0, 1.90, 1.85, 1.80])},
                     {"seed": 1, "curve": curve([2.0, 1.92, 1.86, 1.82])},
                     {"seed": 2, "curve": curve([2.0, 1.91, 1.84, 1.79])}]
    ada = _row("raycomp_adaptive", 60.0, final=1.88)
    ada["runs"] = [{"seed": 0, "curve": curve([2.0, 1.93, 1.869])},  # stopped at step 48: +1.03%
                   {"seed": 1, "curve": curve([2.0, 1.93])},  # stopped at step 32: +0.52%
                   {"seed": 2, "curve": curve([2.1, 1.92, 1.85, 1.80])}]  # the whole budget: +0.56%
    goal = judge.judge(_results([dense, ada], workload="lstm"))[1]
    assert goal["value"] == pytest.approx((1.80 - 1.79) / 1.79) and goal["ok"]  # seed 2's, the median
    assert goal["detail"] == "seed 0 at step 48: +1.03%; seed 1 at step 32: +0.52%; seed 2 at step 64: +0.56%"
    # higher is better (accuracy): a lower accuracy is worse
    results = _results([dense, ada], workload="cnn")
    results["target"] = {"metric": "accuracy", "lower_is_better": False}
    assert judge.judge(results)[1]["value"] == pytest.approx(-(1.80 - 1.79) / 1.79)
    # no seed both ran: no number, a MISS
    ada["runs"] = [{"seed": 5, "curve": curve([2.0])}]
    assert judge.judge(_results([dense, ada], workload="lstm"))[1]["ok"] is False


def test_the_goals_table_names_only_known_scopes_measures_and_comparisons():
    from jobs.bench.e2e.goals import GOALS, SCOPES

    scopes = [name for name, _ in SCOPES]
    assert SCOPES[-1][1] == {}  # the last scope takes any report the others leave
    for goal in GOALS:
        assert goal.scope in scopes and goal.measure in judge.MEASURES, goal
        assert goal.comparison in judge.COMPARISONS, goal
        assert (goal.threshold is None) == (goal.comparison == "present"), goal
        assert all(n in methods.METHODS or n in methods.GRIDS for n in goal.needs), goal
    assert {g.scope for g in GOALS} == set(scopes)
    # FSDP is judged by its own goals whatever the link; the fast link by its one goal whatever the workload
    rows = [_row("dense", 300.0), _row("raycomp_adaptive", 240.0)]
    assert judge.scope_of({**_results(rows, rate="fast"), "strategy": "fsdp"}) == "fsdp"
    assert judge.scope_of(_results(rows, workload="cnn", rate="fast")) == "fast link"
    assert judge.scope_of(_results(rows, workload="cnn")) == "other workloads"


# --- the compute bound and the grids ------------------------------------------------------------
def test_the_compute_bound_is_dense_steps_to_target_times_the_step_without_communication():
    assert analysis.compute_bound({"steps_to_target": 288}, 0.21) == pytest.approx(60.48)
    assert analysis.compute_bound({"steps_to_target": None}, 0.21) is None  # dense missed
    assert analysis.compute_bound(None, 0.21) is None and analysis.compute_bound({"steps_to_target": 288}, None) is None


def test_a_grid_is_reported_under_its_name_with_its_fastest_setting():
    def row(name, t, final):
        return {"name": name, "time_to_target_s": t, "time_to_target_s_seeds": [t], "final_metric": final,
                "nic_bytes_to_stop": 1.0, "step_s": 0.3}

    rows = [row("dense", 400.0, 2.20), row("torch_postlocalsgd_h4", 120.0, 2.25),
            row("torch_postlocalsgd_h8", 100.0, 2.26), row("torch_postlocalsgd_h16", None, 2.21),
            row("torchft_diloco_h4", None, 2.40), row("torchft_diloco_h8", None, 2.35), row("raycomp_adaptive", 80.0, 2.2)]
    out = analysis.best_of_grids(rows, lower_is_better=True)
    assert [m["name"] for m in out] == ["dense", "torch_postlocalsgd", "torchft_diloco", "raycomp_adaptive"]
    local, diloco = out[1], out[2]
    assert (local["variant"], local["time_to_target_s"]) == ("torch_postlocalsgd_h8", 100.0)  # fastest, not best loss
    assert [(g["setting"], g["time_to_target_s"]) for g in local["grid"]] == [(4, 120.0), (8, 100.0), (16, None)]
    assert diloco["variant"] == "torchft_diloco_h8"  # none reached the target: the best final loss
    accuracy = analysis.best_of_grids([row("torchft_diloco_h4", None, 0.80), row("torchft_diloco_h8", None, 0.85)],
                                      lower_is_better=False)
    assert accuracy[0]["variant"] == "torchft_diloco_h8"


def test_a_grid_searched_on_one_seed_is_judged_on_that_seed():
    def row(name, seeds, ttt, final):
        return {"name": name, "time_to_target_s": stats.median_with_misses(ttt), "time_to_target_s_seeds": ttt,
                "final_metric": stats.median(final), "final_metric_seeds": final, "nic_bytes_to_stop": 1.0,
                "step_s": 0.3, "runs": [{"seed": s} for s in seeds]}

    # H=8 ran seeds 0-2 (median 90 s) but took 120 s on seed 0, where H=4 took 100 s
    rows = [row("raycomp_local_h4", [0], [100.0], [2.0]), row("raycomp_local_h8", [0, 1, 2], [120.0, 90.0, 90.0],
                                                              [2.0, 2.0, 2.0]),
            row("raycomp_local_h16", [0], [None], [2.1])]
    (local,) = analysis.best_of_grids(rows, lower_is_better=True)
    assert local["variant"] == "raycomp_local_h4" and local["time_to_target_s"] == 100.0
    assert [g["seeds"] for g in local["grid"]] == [[0], [0, 1, 2], [0]]
    line = report._grid_seeds(local["grid"][1], local["grid"])
    assert line == " (seeds 0, 1, 2)" and report._grid_seeds(local["grid"][0], local["grid"]) == " (seed 0)"
    # every variant on seeds 0-2: judged on all three (H=8's median 90 s beats H=4's 100 s)
    rows[0] = row("raycomp_local_h4", [0, 1, 2], [100.0, 100.0, 100.0], [2.0, 2.0, 2.0])
    rows[2] = row("raycomp_local_h16", [0, 1, 2], [None, None, None], [2.1, 2.1, 2.1])
    assert analysis.best_of_grids(rows, lower_is_better=True)[0]["variant"] == "raycomp_local_h8"


def _phase(path: Path, runs: list[dict[str, Any]], methods_: list[str], seeds: list[int], stop: float | None,
           steps: int = 40) -> Path:
    path.mkdir()
    settings = {"workload": "gpt", "config": "jobs/configs/gpt_kjv.yaml", "mode": "full", "steps": steps,
                "eval_every": 10, "seeds": seeds, "target": None, "link": "100mbit", "methods": methods_,
                "strategy": "ddp", "extra": []}
    raw = {"layers": {"w": [100, 2]}, "metric": "loss", "interval_steps": 10, "bucket_cap_mb": 1.0,
           "default_policy": "adaptive", "idle": [{"seconds": 10.0, "tx_bytes": 50, "rx_bytes": 50}], "runs": runs}
    if stop is not None:
        raw["stop_target"] = stop
    meta = {"settings": settings, "shaping": {"qdisc": {"a": "tbf"}, "rate": "100mbit"},
            "check": {"a_to_b": {"bits_per_s": 95.7e6}, "b_to_a": {"bits_per_s": 95.6e6}, "rtt": {"median_s": 2e-5}},
            "command": f"python -m jobs.bench e2e --methods {','.join(methods_)}", "machine": {},
            "benchmark_seconds": 100.0, "load_average": {"start": [0.1], "end": [0.2]}}
    (path / "raw.json").write_text(json.dumps(raw))
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_phases_of_one_benchmark_merge_into_one_report(tmp_path):
    from jobs.bench.e2e.merge import merge_work

    dense = [raw_run(methods.COMPUTE, 0, [3.0, 3.0], 0.15, 0.0),
             *[raw_run("dense", s, [3.0, 2.6, 2.4, 2.3], 1.0, 800.0) for s in (0, 1)],
             *[raw_run(methods.NO_COMM, s, [3.0, 3.0], 0.25, 0.0) for s in (0, 1)]]
    first = _phase(tmp_path / "a", dense, ["dense"], [0, 1], 2.40001)  # the others typed it as 2.4
    grid = [raw_run(methods.COMPUTE, 0, [3.0, 3.0], 0.5, 0.0), raw_run(methods.NO_COMM, 0, [3.0, 3.0], 0.9, 0.0),
            raw_run("raycomp_local_h4", 0, [3.0, 2.4, 2.4, 2.4], 0.3, 0.0),
            raw_run("raycomp_local_h8", 0, [3.0, 2.6, 2.4, 2.4], 0.3, 0.0)]
    second = _phase(tmp_path / "b", grid, ["raycomp_local"], [0], 2.4)
    best = _phase(tmp_path / "c", [raw_run("raycomp_local_h4", 1, [3.0, 2.6, 2.4, 2.4], 0.3, 0.0)],
                  ["raycomp_local_h4"], [1], 2.4)
    raw, meta = merge_work([first, second, best])
    assert [(r["method"], r["seed"]) for r in raw["runs"]] == [
        (methods.COMPUTE, 0), ("dense", 0), ("dense", 1), (methods.NO_COMM, 0), (methods.NO_COMM, 1),
        ("raycomp_local_h4", 0), ("raycomp_local_h8", 0), ("raycomp_local_h4", 1)]  # the first phase's references
    assert meta["settings"]["methods"] == ["dense", "raycomp_local", "raycomp_local_h4"]
    assert meta["settings"]["seeds"] == [0, 1] and meta["benchmark_seconds"] == 300.0
    assert meta["command"].splitlines()[1] == "python -m jobs.bench e2e --methods raycomp_local"
    results = analysis.analyze(raw, meta["settings"], meta["shaping"], meta["check"])
    local = next(m for m in results["methods"] if m["name"] == "raycomp_local")
    assert local["variant"] == "raycomp_local_h4" and len(local["runs"]) == 2  # seed 0's grid, then seed 1
    assert results["compute_step_s"] == pytest.approx(0.15) and results["no_comm_step_s"] == pytest.approx(0.25)
    # what phases must share
    with pytest.raises(ValueError, match="settings.steps is 80"):
        merge_work([first, _phase(tmp_path / "d", grid, ["raycomp_local"], [0], 2.4, steps=80)])
    with pytest.raises(ValueError, match="stopped at target 2.5"):
        merge_work([first, _phase(tmp_path / "e", grid, ["raycomp_local"], [0], 2.5)])
    # a method re-run in a later directory replaces the earlier runs of the same seeds
    rerun = _phase(tmp_path / "f", [raw_run("raycomp_local_h8", 0, [3.0, 2.4, 2.4, 2.4], 0.2, 0.0)],
                   ["raycomp_local_h8"], [0], 2.4)
    raw, _ = merge_work([first, second, best, rerun])
    h8 = [r for r in raw["runs"] if r["method"] == "raycomp_local_h8"]
    assert len(h8) == 1 and h8[0]["steps"][1]["time"] - h8[0]["steps"][0]["time"] == pytest.approx(0.2)
    assert [r["method"] for r in raw["runs"]][-2:] == ["raycomp_local_h4", "raycomp_local_h8"]
    # the command line: --reanalyze with several directories writes one report, or exits 2
    import argparse

    from jobs.bench.e2e import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "reports"
    assert cli.run(parser.parse_args(["--reanalyze", str(first), str(second), str(best), "--output-dir", str(out)]),
                   []) == 0
    text = (out / "e2e-gpt-100mbit.md").read_text()
    assert "raycomp_local_h4: " in text and "(seeds 0, 1)" in text and "(seed 0)" in text
    assert cli.run(parser.parse_args(["--reanalyze", str(first), str(tmp_path / "d"), "--output-dir",
                                      str(out)]), []) == 2


def test_merged_phases_are_judged_at_the_target_their_runs_stopped_at():
    def dense(value):
        return {"method": "dense", "curve": [{"step": 30, "value": value}]}

    settings = {"steps": 40, "target": None}
    # a later phase's dense seed moves the median from 2.45 (the first phase's two seeds) to 2.5
    target = analysis.resolve_target([dense(2.4), dense(2.5), dense(2.5)], settings, "loss", stopped_at=2.45)
    assert target["value"] == 2.45 and "every run stopped at (over every seed: 2.5)" in target["source"]
    assert analysis.resolve_target([dense(2.4), dense(2.5)], settings, "loss", stopped_at=2.45)["value"] == 2.45
    assert analysis.resolve_target([dense(2.4), dense(2.5), dense(2.5)], settings, "loss")["value"] == 2.5


def test_the_byte_models_of_the_local_step_baselines():
    layers = {"w": [10, 10]}
    dense = 2 * (2 - 1) / 2 * 4 * 100
    # post-local SGD: DDP for W=3 steps, then the parameters all-reduced after steps 3, 7, 11
    assert traces.torch_hook_bytes("localsgd", layers, 2, 12, start_iter=3, period=4) == \
        [dense] * 4 + [0.0] * 3 + [dense] + [0.0] * 3 + [dense]
    # DiLoCo: the pseudo-gradient after every 4th step (steps 3, 7, 11)
    assert traces.torch_hook_bytes("diloco", layers, 2, 12, period=4) == ([0.0] * 3 + [dense]) * 3


# --- the order of the runs, the target and the stops ----------------------------------------------
def test_an_auto_target_runs_dense_first_then_every_other_method_seed_major():
    from jobs.bench.e2e.driver import run_phases

    settings = {"seeds": [0, 1], "methods": ["dense", "raycomp_int4", "raycomp_adaptive"], "target": None}
    first, second = run_phases(settings)
    assert first == [(methods.COMPUTE, 0), ("dense", 0), ("dense", 1)]
    assert second == [(methods.NO_COMM, 0), ("raycomp_int4", 0), ("raycomp_adaptive", 0),
                      (methods.NO_COMM, 1), ("raycomp_int4", 1), ("raycomp_adaptive", 1)]
    # a fixed target: one phase, dense stops at it like everyone else
    assert run_phases({**settings, "target": 2.3}) == [[(methods.COMPUTE, 0), (methods.NO_COMM, 0), ("dense", 0),
                                                        ("raycomp_int4", 0), ("raycomp_adaptive", 0),
                                                        (methods.NO_COMM, 1), ("dense", 1), ("raycomp_int4", 1),
                                                        ("raycomp_adaptive", 1)]]


def test_the_auto_target_is_dense_median_at_the_fixed_step():
    def run(method, values, every=16):
        return {"method": method, "evals": [{"step": every * (k + 1), "eval_loss": v} for k, v in enumerate(values)]}

    runs = [run("dense", [3.0, 2.5, 2.4, 2.3]), run("dense", [3.0, 2.6, 2.2, 2.1]), run("dense", [3.0, 2.7, 2.35, 2.0]),
            run("raycomp_int4", [1.0, 1.0, 1.0, 1.0])]
    settings = {"steps": 64}
    assert analysis.target_step(settings) == 48 and analysis.auto_target(runs, "loss", settings) == 2.35
    assert analysis.auto_target(runs, "loss", {"steps": 64, "target_step": 17}) == 2.6  # the evaluation at 32
    assert analysis.auto_target(runs, "loss", {"steps": 64, "target_step": 64}) == 2.1
    assert analysis.auto_target(runs[3:], "loss", settings) is None  # no dense run


def test_every_run_stops_once_the_target_held_twice_and_nic_bytes_count_to_the_stop():
    curve = [{"step": 16 * (k + 1), "value": v, "train_s": 10.0 * (k + 1)} for k, v in enumerate([3.0, 2.2, 2.1, 2.0])]
    run = {"method": "raycomp_adaptive", "curve": curve, "final_metric": 2.0, "wire_bytes": 1.0, "dense_bytes": 2.0,
           "nic_bytes": 4000.0, "nic_bytes_at_eval": {16: 1000.0, 32: 2000.0, 48: 3000.0, 64: 4000.0},
           "nic_bytes_per_step": 1.0, "step_s": 0.3, "control_share": 0.0, "first_compressed_step": 20,
           "status": "succeeded", "error": None, "steps": 64}
    row = analysis.aggregate([run], 2.2, lower_is_better=True)
    # the target holds at steps 32 and 48: time to target at 32, the run stops (and its bytes end) at 48
    assert (row["time_to_target_s"], row["steps_to_target"], row["nic_bytes_to_stop"]) == (20.0, 32, 3000.0)
    missed = analysis.aggregate([run], 1.5, lower_is_better=True)
    assert (missed["time_to_target_s"], missed["nic_bytes_to_stop"]) == (None, 4000.0)  # to its end
    settings = {"extra": [], "steps": 64, "eval_every": 16, "target": 2.2}
    overrides = methods.method_overrides("torch_bf16", settings, 0, 10, 16.0)
    assert "workload.stop_at_target=2.2" in overrides and "workload.stop_consecutive=2" in overrides
    for name in (methods.COMPUTE, methods.NO_COMM):  # the references run their few steps
        assert not any(o.startswith("workload.stop_at_target") for o in methods.method_overrides(name, settings, 0, 10, 16.0))
    assert not any(o.startswith("workload.stop_at_target")
                   for o in methods.method_overrides("dense", {**settings, "target": None}, 0, 10, 16.0))


# --- the runs' configs ----------------------------------------------------------------------------
def test_every_method_gets_the_same_budget_seed_cadence_and_its_own_warmup():
    settings = {"extra": [], "steps": 400, "eval_every": 16, "target": None}
    shared = None
    for name in [*methods.METHODS, methods.COMPUTE, methods.NO_COMM]:
        overrides = methods.method_overrides(name, settings, seed=1, interval=10, bucket_cap_mb=16.0)
        if name.startswith("torchft") and methods.available(name):
            continue
        config = load_config(REPO / "jobs/configs/gpt_kjv.yaml", overrides)
        w, c, b = config.workload, config.compression, config.benchmark
        assert (config.run.seed, w.steps_per_epoch * w.epochs, w.eval_every_steps) == (1, 400, 16), name
        assert (w.lr, w.lr_schedule, w.batch_size) == (0.002, "cosine", 6)
        assert config.scaling.num_workers == (1 if name == methods.COMPUTE else 2), name
        assert (b.baseline == "torch_noop") == (name == methods.NO_COMM), name
        assert (b.bucket_cap_mb is not None) == name.startswith("torch_powersgd")
        if name == methods.COMPUTE:
            continue
        # no shared warm-up: raycomp keeps its own default, torch's hooks get their own
        assert c.warmup_steps == 20, name
        assert b.warmup_steps == 0, name
        if name.startswith("torch_powersgd"):
            assert (b.powersgd_rank, b.powersgd_start_iter) == (int(name[-1]), 40)  # torch's docs: 10%
        if name.startswith("torch_postlocalsgd"):
            # about 10%, W + 1 a multiple of every H: the averages fall on the evaluations (48, 64, ...)
            assert (b.localsgd_period, b.localsgd_start_iter) == (methods.grid_setting(name), 47)
        if name.startswith("torchft_diloco"):
            assert b.diloco_sync_every == methods.grid_setting(name)
        # raycomp's local steps: fixed H over the grid; adaptive is the default with the switch on
        assert (c.local.mode, c.local.sync_every) == (
            ("fixed", methods.grid_setting(name)) if name.startswith("raycomp_local") else
            ("auto", 8) if name.startswith("raycomp_adaptive") and name != "raycomp_adaptive_per_step" else
            ("off", 8)), name
        # two levels by default; the flat ablations say so
        flat = name in ("raycomp_int4", "raycomp_adaptive_flat") or name.startswith("raycomp_local_flat")
        assert c.levels == ("flat" if flat else "auto"), name
        key = w.model_dump()
        shared = shared or key
        assert key == shared, name
    assert [methods.warmup_of("torch_postlocalsgd_h4", {"steps": n}) for n in (64, 320, 400, 480)] == [15, 31, 47, 47]
    start = methods.method_overrides("torch_postlocalsgd_h8", {**settings, "localsgd_start": 0}, 0, 10, 16.0)
    assert load_config(REPO / "jobs/configs/gpt_kjv.yaml", start).benchmark.localsgd_start_iter == 0


def test_the_lstm_workload_runs_its_own_config_at_the_benchmark_budget():
    spec = methods.WORKLOADS["lstm"]
    settings = {"extra": spec.get("overrides", []), "steps": 400, "eval_every": spec["eval_every"], "target": None}
    for name in ("dense", "torch_powersgd_r4", "raycomp_adaptive"):
        config = load_config(REPO / spec["config"], methods.method_overrides(name, settings, 0, 10, 16.0))
        w = config.workload
        assert (w.model, w.optimizer, w.steps_per_epoch * w.epochs, w.eval_every_steps) == ("lstm", "sgd", 400, 16)


def test_the_default_run_holds_the_methods_that_matter():
    names = methods.parse_methods(None, quick=False, workload="gpt")
    assert names[:4] == ["dense", "torch_bf16", "torch_powersgd_r4", "raycomp_int4"]
    assert names[-1] == "raycomp_adaptive"
    # each local-step grid at the transformer's best H; torchft's DiLoCo where this checkout runs it
    assert [n for n in names if methods.family(n) != n] == [
        "torch_postlocalsgd_h4", *(["torchft_diloco_h16"] if methods.available("torchft_diloco_h16") is None else []),
        "raycomp_local_h4"]
    cnn = methods.parse_methods(None, quick=False, workload="cnn")
    assert [n for n in cnn if methods.family(n) in ("torch_postlocalsgd", "raycomp_local")] == \
        ["torch_postlocalsgd_h16", "raycomp_local_h8"]
    # a workload without a best H for a grid runs the whole grid; a grid's name runs every H
    mlp = methods.parse_methods(None, quick=False, workload="mlp")
    assert [n for n in mlp if methods.family(n) == "raycomp_local"] == methods.GRIDS["raycomp_local"]
    assert methods.parse_methods("raycomp_local", quick=False, workload="gpt") == methods.GRIDS["raycomp_local"]
    for spec in methods.WORKLOADS.values():  # a best H is one of its grid's
        assert all(f"{grid}_h{h}" in methods.GRIDS[grid] for grid, h in spec.get("best_h", {}).items())
    assert not {"raycomp_topk", "raycomp_dgc", "torch_fp16", "torch_powersgd_r1"} & set(names)
    every = methods.parse_methods(None, quick=False, all_methods=True)
    assert {"raycomp_topk", "raycomp_dgc", "torch_fp16", "torch_powersgd_r1"} <= set(every)
    assert every == methods.parse_methods("all", quick=False)
    # a grid's name stands for its settings
    assert methods.parse_methods("dense,torch_postlocalsgd", quick=False) == ["dense", *methods.GRIDS["torch_postlocalsgd"]]
    with pytest.raises(SystemExit, match=r"--methods: unknown \['magic'\]; allowed with --strategy ddp: dense, "):
        methods.parse_methods("dense,magic", quick=False)


def test_the_command_line_refuses_an_evaluation_cadence_that_splits_a_local_step_period():
    import argparse

    from jobs.bench.e2e import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    settings = cli.settings_from(parser.parse_args(["--methods", "dense,torch_postlocalsgd"]))
    assert (settings["steps"], settings["eval_every"], settings["target"], settings["localsgd_start"]) == (320, 16, None, None)
    with pytest.raises(SystemExit, match=r"--eval-every 20 must be a multiple of every local-step H run \(4, 8, 16\)"):
        cli.settings_from(parser.parse_args(["--methods", "torch_postlocalsgd", "--eval-every", "20", "--steps", "400"]))
    with pytest.raises(SystemExit, match=r"--localsgd-start 40: W \+ 1 must be a multiple of every post-local SGD "
                                         r"period run \(4, 8, 16\)"):
        cli.settings_from(parser.parse_args(["--methods", "torch_postlocalsgd", "--localsgd-start", "40"]))
    assert cli.settings_from(parser.parse_args(["--localsgd-start", "31"]))["localsgd_start"] == 31
    with pytest.raises(SystemExit, match=r"--steps 390 must be a multiple of --eval-every 16"):
        cli.settings_from(parser.parse_args(["--steps", "390"]))
    with pytest.raises(SystemExit, match=r"--target-step must be in 1..320"):
        cli.settings_from(parser.parse_args(["--target-step", "321"]))
    assert cli.settings_from(parser.parse_args(["--quick"]))["steps"] == 64
    # the language-model workload's budget is its own: thousands of steps, evaluated every 80
    lm = cli.settings_from(parser.parse_args(["--workload", "lm", "--methods", "dense,raycomp_local"]))
    assert (lm["steps"], lm["eval_every"], lm["config"]) == (2000, 80, "jobs/configs/lm_kjv.yaml")


def test_fsdp_methods_share_the_budget_and_differ_only_in_the_reduce_scatter():
    settings = {"extra": [], "steps": 160, "eval_every": 20, "target": None, "strategy": "fsdp"}
    seen = {}
    for name in methods.FSDP_METHODS:
        config = load_config(REPO / "jobs/configs/gpt_kjv.yaml", methods.method_overrides(name, settings, 2, 10, 16.0))
        w, c = config.workload, config.compression
        assert config.scaling.strategy == "fsdp", name
        assert (config.run.seed, w.steps_per_epoch * w.epochs, w.eval_every_steps, c.warmup_steps) == (2, 160, 20, 20)
        seen[name] = (config.benchmark.baseline, c.policy, c.static.compressor.name if c.policy == "static" else None)
    assert seen == {"dense": ("torch_fsdp", "static", "none"), "torch_bf16": ("torch_fsdp_bf16", "static", "none"),
                    "raycomp_bf16": ("none", "static", "bf16"), "raycomp_int8": ("none", "static", "int8"),
                    "raycomp_adaptive": ("none", "adaptive", None), "torch_hsdp": ("torch_hsdp", "static", "none"),
                    "raycomp_adaptive_flat": ("none", "adaptive", None)}
    flat = load_config(REPO / "jobs/configs/gpt_kjv.yaml", methods.method_overrides("raycomp_adaptive_flat", settings, 2, 10, 16.0))
    assert flat.compression.levels == "flat"
    with pytest.raises(SystemExit, match="allowed with --strategy fsdp: dense, torch_bf16, raycomp_bf16"):
        methods.parse_methods("raycomp_topk", quick=False, strategy="fsdp")


def test_fsdp_goals_and_report_names():
    rows = [_row("dense", 300.0, nic=20e6), _row("torch_bf16", 250.0), _row("raycomp_adaptive", 240.0, nic=14e6)]
    results = {**_results(rows), "strategy": "fsdp"}
    goals = judge.judge(results)
    assert [g["value"] for g in goals] == [pytest.approx(1.25), pytest.approx(20 / 14), pytest.approx(0.96)]
    assert [g["ok"] for g in goals] == [True, True, True] and "FSDP" in goals[0]["goal"]
    rows[-1].update(time_to_target_s=None, nic_bytes_per_step=21e6 / 100)
    assert [g["ok"] for g in judge.judge(results)] == [False, False, False]
    assert report.report_stem({**results, "link": {"rate": "100mbit"}}) == "fsdp-gpt-100mbit"
    assert report.modeled(results, "dense") and not report.modeled(results, "raycomp_int8")
    assert not report.modeled(results, "torch_powersgd_r1")


# --- schema ---------------------------------------------------------------------------------
def test_analyze_writes_the_documented_schema(tmp_path):
    settings = {"workload": "gpt", "config": "jobs/configs/gpt_kjv.yaml", "mode": "quick", "steps": 40,
                "eval_every": 10, "seeds": [0, 1], "target": None, "link": "100mbit"}
    raw = {"layers": {"w": [100, 2], "b": [2]}, "metric": "loss", "interval_steps": 10, "bucket_cap_mb": 1.0,
           "default_policy": "critical", "idle": [{"seconds": 10.0, "tx_bytes": 50, "rx_bytes": 50}],
           "runs": [raw_run(methods.COMPUTE, 0, [3.0, 3.0], 0.15, 0.0),
                    raw_run("dense", 0, [3.0, 2.6, 2.4, 2.3], 1.0, 800.0),
                    raw_run("dense", 1, [3.0, 2.7, 2.4, 2.3], 1.0, 800.0),
                    raw_run(methods.NO_COMM, 0, [3.0, 3.0], 0.25, 0.0),
                    raw_run("torch_postlocalsgd_h4", 0, [3.0, 2.6, 2.4, 2.4], 0.35, 0.0),
                    raw_run("torch_postlocalsgd_h8", 0, [3.0, 2.4, 2.4, 2.4], 0.3, 0.0),
                    raw_run("raycomp_adaptive", 0, [3.0, 2.5, 2.4, 2.35], 0.3, 8.0),
                    raw_run(methods.NO_COMM, 1, [3.0, 3.0], 0.2, 0.0),
                    raw_run("torch_postlocalsgd_h4", 1, [3.0, 2.6, 2.4, 2.4], 0.35, 0.0),
                    raw_run("torch_postlocalsgd_h8", 1, [3.0, 2.4, 2.4, 2.4], 0.3, 0.0),
                    raw_run("raycomp_adaptive", 1, [3.0, 2.6, 2.6, 2.6], 0.4, 8.0)]}
    check = {"a_to_b": {"bits_per_s": 95.7e6}, "b_to_a": {"bits_per_s": 95.6e6}, "rtt": {"median_s": 2e-5}}
    shaping = {"qdisc": {"a": "tbf rate 100000000bit"}, "rate": "100mbit"}
    results = analysis.analyze(raw, settings, shaping, check)
    assert set(results) >= {"workload", "link", "target", "seeds", "compute_step_s", "methods", "goals",
                            "compute_bound_time_to_target_s"}
    assert results["workload"]["name"] == "gpt" and results["workload"]["parameters"] == 202
    assert results["link"] == {**results["link"], "rate": "100mbit", "measured_mbit_s": 95.6}
    # auto target: dense's median at the first evaluation at or after 3/4 of 40 steps (step 30)
    assert results["target"] == {**results["target"], "metric": "loss", "value": 2.4, "lower_is_better": True,
                                 "step": 30}
    assert results["compute_step_s"] == pytest.approx(0.15)
    # each seed's step over the no-communication step of its own group: 0.3 / 0.25 and 0.4 / 0.2
    assert results["no_comm_step_s"] == pytest.approx(0.225)
    assert results["no_comm_step_s_seeds"] == {"0": pytest.approx(0.25), "1": pytest.approx(0.2)}
    assert [m["name"] for m in results["methods"]] == ["dense", "torch_postlocalsgd", "raycomp_adaptive"]
    dense, local, ada = results["methods"]
    required = {"name", "time_to_target_s", "time_to_target_s_seeds", "final_metric", "wire_bytes",
                "nic_bytes", "nic_bytes_to_stop", "step_s", "control_share", "vs_compute_bound"}
    assert required <= set(dense) and required <= set(local)
    # dense: 2.4 @30 and 2.3 @40 on both seeds -> hit at step 30 = 29 one-second steps after step 0
    assert dense["time_to_target_s_seeds"] == [pytest.approx(29.0)] * 2 and dense["steps_to_target"] == 30
    # the physical limit: dense's 30 steps x the 0.225 s step without communication
    assert results["compute_bound_time_to_target_s"] == pytest.approx(30 * 0.225)
    assert local["vs_compute_bound"] == pytest.approx(0.3 * 19 / (30 * 0.225))
    # post-local SGD: H=8 reached the target at step 20 on both seeds, H=4 at step 30 (slower)
    assert (local["variant"], local["time_to_target_s"]) == ("torch_postlocalsgd_h8", pytest.approx(0.3 * 19))
    assert [g["variant"] for g in local["grid"]] == ["torch_postlocalsgd_h4", "torch_postlocalsgd_h8"]
    assert local["warmup_steps"] == 15  # W + 1 a multiple of 16 (the grid's periods)
    # bytes: the averager's model, dense for steps 0-14, then every 8th step from step 15
    per_rank = 4 * 202 * sum(1 for s in range(40) if s < 15 or (s - 15) % 8 == 0)
    assert local["wire_bytes"] == pytest.approx(2 * per_rank)
    # adaptive seed 1 never reaches 2.4: a miss, median of [hit, miss] is a miss
    assert ada["time_to_target_s_seeds"] == [pytest.approx(0.3 * 29), None] and ada["time_to_target_s"] is None
    assert ada["final_metric"] == pytest.approx(2.475) and ada["first_compressed_step_seeds"] == [20, 20]
    assert dense["wire_bytes"] == pytest.approx(2 * 4 * 202 * 40)  # the byte model of allreduce_hook
    assert ada["step_s"] == pytest.approx(0.35) and ada["control_share"] == pytest.approx(0.004)
    assert ada["step_vs_no_comm"] == pytest.approx((1.2 + 2.0) / 2)
    json.dumps(results, allow_nan=False)
    paths = report.write_reports({**results, "command": "python -m jobs.bench e2e --quick"}, tmp_path)
    assert [p.name for p in paths] == ["e2e-gpt-100mbit.json", "e2e-gpt-100mbit.md", "e2e-gpt-100mbit.png"]
    text = paths[1].read_text()
    assert "MISS" in text and "raycomp_adaptive" in text and "torch_postlocalsgd (torch_postlocalsgd_h8)" in text
    assert "| vs compute-bound |" in text and "**250 / 200 ms** (seeds 0, 1)" in text
    assert f"without communication = **{results['compute_bound_time_to_target_s']:.1f} s**; at most **4.30x**" in text
    assert "torch_postlocalsgd_h4: 10.2 / 2.4000; torch_postlocalsgd_h8: 5.7 / 2.4000" in text
    assert "(physical limit, at the compute-bound time: " in text
    assert text.count("| none |") == 1 and "| 15 steps |" in text  # dense's warm-up, post-local SGD's
    assert json.loads(paths[0].read_text())["methods"][2]["name"] == "raycomp_adaptive"
    # FSDP: dense's bytes are an ideal fp32 reduce-scatter's, half an all-reduce's
    sharded = analysis.analyze(raw, {**settings, "strategy": "fsdp"}, shaping, check)
    assert sharded["strategy"] == "fsdp"
    assert sharded["methods"][0]["wire_bytes"] == pytest.approx(2 * 4 * 202 * 40 / 2)
    assert "FSDP2" in report.render_markdown({**sharded, "command": "x"})


def test_a_run_stopped_early_reports_the_seeds_that_ran(tmp_path):
    settings = {"workload": "gpt", "config": "jobs/configs/gpt_kjv.yaml", "mode": "full", "steps": 40,
                "eval_every": 10, "seeds": [0, 1, 2], "target": None, "link": "100mbit"}
    raw = {"layers": {"w": [100, 2]}, "metric": "loss", "interval_steps": 10, "bucket_cap_mb": 1.0,
           "default_policy": "adaptive", "idle": [],
           "runs": [raw_run("dense", 0, [3.0, 2.6, 2.4, 2.3], 1.0, 800.0),
                    raw_run("dense", 1, [3.0, 2.7, 2.5, 2.3], 1.0, 800.0),
                    raw_run("raycomp_adaptive", 0, [3.0, 2.5, 2.45, 2.4], 0.3, 8.0)]}  # stopped here
    check = {"a_to_b": {"bits_per_s": 95.7e6}, "b_to_a": {"bits_per_s": 95.6e6}, "rtt": {"median_s": 2e-5}}
    results = analysis.analyze(raw, settings, {"qdisc": {"a": "tbf"}, "rate": "100mbit"}, check)
    # dense ran seeds 0 and 1, adaptive seed 0 only: one seed ran every method
    assert results["seeds"] == [0] and results["seeds_requested"] == [0, 1, 2]
    assert results["methods"][1]["time_to_target_s_seeds"] == [pytest.approx(0.3 * 29)]
    assert len(results["methods"][0]["time_to_target_s_seeds"]) == 2  # dense: each seed it ran
    text = report.render_markdown({**results, "command": "x"})
    assert "over a 100mbit link, 1 seed\n" in text
    assert "**Stopped early: 1 of the 3 requested seeds (0, 1, 2) ran every method**" in text


# --- a tiny real run ------------------------------------------------------------------------------
def _root_with_netns() -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


@pytest.mark.benchmark  # two Ray nodes over a throttled veth: minutes; `pytest -m benchmark`
@pytest.mark.skipif(not _root_with_netns(), reason="needs root and iproute2 (network namespaces)")
def test_tiny_real_run_over_the_throttled_link(tmp_path):
    """2 Ray nodes in namespaces, the digits MLP, dense and raycomp Top-K, a 44-step budget."""
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
    assert results["compute_step_s"] > 0 and results["compute_bound_time_to_target_s"] > 0
    for m in results["methods"]:
        assert m["status_seeds"] == ["succeeded"], m["errors"]
        assert m["nic_bytes"] > 0.9 * m["wire_bytes"] > 0
    dense, topk = results["methods"]
    # the auto target: dense ran its whole budget first; Top-K stopped once the target held twice
    assert dense["steps_seeds"] == [44] and [p["step"] for p in dense["runs"][0]["curve"]] == [22, 44]
    assert topk["steps_seeds"][0] <= 44
    # no shared warm-up: raycomp's own (the digits config's compression.warmup_steps, 10)
    assert 10 <= topk["first_compressed_step_seeds"][0] <= 20
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


def test_two_level_goals_judge_against_the_flat_run_of_the_same_method():
    """At several workers per node: adaptive against its flat ablation (not slower), and int4's
    NIC bytes per step flat over two-level (at least the ranks per node, 2)."""
    def results(flat_time, levels_nic):
        rows = [_row("dense", 300.0), _row("raycomp_int4", 200.0, nic=4e6),
                _row("raycomp_int4_levels", 180.0, nic=levels_nic), _row("raycomp_adaptive_flat", flat_time),
                _row("raycomp_adaptive", 100.0)]
        out = _results(rows, workload="cnn")
        out["workload"]["world_size"] = 4
        return {g["measure"]: g for g in judge.judge(out)}

    goals = results(flat_time=100.0, levels_nic=2e6)
    assert goals["time_vs_flat"]["value"] == pytest.approx(1.0) and goals["time_vs_flat"]["ok"]
    assert goals["nic_per_step_flat_vs_levels"]["value"] == pytest.approx(2.0)
    assert goals["nic_per_step_flat_vs_levels"]["ok"]
    goals = results(flat_time=99.0, levels_nic=2.1e6)
    assert not goals["time_vs_flat"]["ok"] and not goals["nic_per_step_flat_vs_levels"]["ok"]
    plain = _results([_row("dense", 300.0), _row("raycomp_adaptive", 100.0)], workload="cnn")
    plain["workload"]["world_size"] = 4
    assert {"time_vs_flat", "nic_per_step_flat_vs_levels"}.isdisjoint(g["measure"] for g in judge.judge(plain))


def test_a_composed_report_times_a_synchronous_curve_by_its_shaped_step():
    """``jobs.bench.e2e.compose``: dense's shaped time to target is its unshaped steps to target
    times its shaped median step, its bytes the steps times its bytes per step; a run made whole
    on the shaped link keeps its own numbers, and must share the curves' target."""
    from jobs.bench.e2e.compose import compose, render

    target = {"value": 1.6, "step": 1520}
    curve = {"name": "dense", "steps_to_target_seeds": [1440, 1520, None], "final_metric": 1.55,
             "final_metric_seeds": [1.55, 1.56, 1.54]}
    curves = {"workload": {"name": "lm"}, "target": target, "seeds": [0, 1, 2], "methods": [curve]}
    shaped = {"link": {"rate": "100mbit"}, "no_comm_step_s": 0.1,
              "methods": [{"name": "dense", "step_s": 0.4, "nic_bytes_per_step": 7e6}]}
    adaptive = {"name": "raycomp_adaptive", "steps_to_target_seeds": [1600, 1680, 1700], "steps_to_target": 1680,
                "step_s": 0.12, "time_to_target_s_seeds": [200.0, 210.0, 230.0], "time_to_target_s": 210.0,
                "nic_bytes_to_stop_seeds": [5e7, 6e7, 7e7], "final_metric": 1.58, "final_metric_seeds": [1.58] * 3}
    results = compose(curves, shaped, [{"target": target, "methods": [adaptive]}])
    dense, ours = results["methods"]
    # a seed that missed counts as infinitely slow: the median of (1440, 1520, miss) is 1520
    assert dense["steps_to_target"] == 1520 and dense["time_to_target_s"] == pytest.approx(1520 * 0.4)
    assert dense["nic_bytes_to_target"] == pytest.approx(1520 * 7e6) and dense["time_to_target_s_seeds"][2] is None
    assert results["compute_bound_time_to_target_s"] == pytest.approx(152.0)
    assert ours["speedup_vs_dense"] == pytest.approx(608 / 210) and ours["bytes_vs_dense"] == pytest.approx(1520 * 7e6 / 6e7)
    assert ours["over_compute_bound"] == pytest.approx(210 / 152)
    assert "raycomp_adaptive" in render(results) and "| dense | composed |" in render(results)
    with pytest.raises(ValueError, match="is not the curves'"):
        compose(curves, shaped, [{"target": {"value": 1.7}, "methods": [adaptive]}])
