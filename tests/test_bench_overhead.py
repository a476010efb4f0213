"""``python -m jobs.bench overhead``: its verdict from the block pairs, its option errors, and
(under ``-m benchmark``) one short real run."""

from __future__ import annotations

import argparse
import json

import pytest

from jobs.bench.cli import build_parser
from jobs.bench.overhead import cli, summary
from jobs.bench.overhead.report import write_report


def _rows(pairs, warmup=0):
    return [{"pair": i, "plain_s": p, "raycomp_s": r, "counted": i >= warmup} for i, (p, r) in enumerate(pairs)]


def test_the_verdict_is_the_median_of_the_paired_ratios_without_the_warm_up_pairs():
    # the hour drifts 2x between pairs; each pair's ratio is what counts: 1.02, 1.01, 1.04
    rows = _rows([(9.0, 1.0), (1.0, 1.02), (2.0, 2.02), (1.5, 1.56)], warmup=1)
    s = summary.summarize(rows, block=10)
    assert s["pairs"] == 3 and s["ratio_median"] == pytest.approx(1.02) and s["ok"]
    assert s["plain_step_ms"] == pytest.approx(150.0) and s["raycomp_step_ms"] == pytest.approx(156.0)
    assert s["ratio_q1"] <= s["ratio_median"] <= s["ratio_q3"]
    # 1.04 in the middle: a MISS; the warm-up pair's 0.11 would have pulled the median down
    rows = _rows([(9.0, 1.0), (1.0, 1.04), (2.0, 2.1), (1.5, 1.5)], warmup=1)
    assert summary.summarize(rows, block=10)["ok"] is False
    with pytest.raises(ValueError, match="no counted block pair"):
        summary.summarize(_rows([(1.0, 1.0)], warmup=1), block=10)


def test_the_report_says_whether_the_pairs_resolve_the_goal(tmp_path):
    # 60 pairs tightly around 1.05: the median's interval lies above 1.03, a resolved MISS
    tight = _rows([(1.0, 1.05 + 0.002 * ((i % 5) - 2)) for i in range(60)])
    s = summary.summarize(tight, block=20)
    assert s["ratio_median_low"] > summary.GOAL and s["resolved"] and not s["ok"]
    assert s["ratio_median_low"] <= s["ratio_median"] <= s["ratio_median_high"]
    assert summary.summarize(tight, block=20) == s  # seeded: the same report every time
    # 40 pairs spread from 0.95 to 1.11 around 1.03: a median near the goal, not resolved
    wide = _rows([(1.0, 0.95 + 0.004 * i) for i in range(41)])
    w = summary.summarize(wide, block=20)
    assert w["ratio_median_low"] < summary.GOAL < w["ratio_median_high"] and not w["resolved"]
    meta = {"command": "python -m jobs.bench overhead", "machine": {"cpu_model": "x", "logical_cores": 2},
            "seconds": 10.0, "batch": 32, "warmup_pairs": 0, "bucket_cap_mb": "auto"}
    result = {"rows": wide, "summary": w, "plan": {"reason": "static: none"}, "steps": 60, "wire_bytes_total": 1,
              "dense_bytes_total": 1, "controller_outages": 0, "stats_dropped": 0}
    _, md_path = write_report(result, meta, tmp_path, "overhead-wide")
    text = md_path.read_text()
    assert f"| {w['ratio_median_low']:.3f} - {w['ratio_median_high']:.3f} |" in text
    assert f"(not resolved: the median's 95% interval, {w['ratio_median_low']:.3f}-" in text


def test_the_hook_alone_is_reported_beside_the_verdict_when_measured(tmp_path):
    rows = [{"pair": i, "plain_s": 1.0, "hook_s": h, "raycomp_s": r, "counted": True}
            for i, (h, r) in enumerate([(1.01, 1.05), (1.02, 1.06), (1.00, 1.04)])]
    s = summary.summarize(rows, block=20)
    assert s["hook_ratio_median"] == pytest.approx(1.01) and s["hook_step_ms"] == pytest.approx(50.5)
    assert s["ratio_median"] == pytest.approx(1.05) and not s["ok"]  # the verdict stays raycomp.train's
    assert "hook_ratio_median" not in summary.summarize(_rows([(1.0, 1.0)]), block=20)  # an older report's rows
    result = {"rows": rows, "summary": s, "plan": {"reason": "static: none"}, "steps": 60, "wire_bytes_total": 1,
              "dense_bytes_total": 1, "controller_outages": 0, "stats_dropped": 0}
    meta = {"command": "python -m jobs.bench overhead", "machine": {"cpu_model": "x", "logical_cores": 2},
            "seconds": 10.0, "batch": 32, "warmup_pairs": 0, "bucket_cap_mb": "auto"}
    _, md_path = write_report(result, meta, tmp_path, "overhead-hook")
    assert "raycomp's hook alone (no `raycomp.train` loop): 50.5 ms a step, 1.010x plain DDP's" in md_path.read_text()


@pytest.mark.parametrize("option, message", [
    ("--pairs=0", "overhead: --pairs must be >= 1, got 0"),
    ("--block=0", "overhead: --block must be >= 1, got 0"),
    ("--warmup-pairs=-1", "overhead: --warmup-pairs must be >= 0, got -1"),
    ("--model=gru", "overhead: --model must be one of cnn, lstm, got 'gru'"),
    ("--plan=int8", "overhead: --plan must be one of dense, bf16, got 'int8'"),
    ("--workers=1", "overhead: --workers must be >= 2, got 1"),
])
def test_bad_options_stop_with_one_line_before_ray_starts(option, message):
    args = build_parser().parse_args(["overhead", option])
    with pytest.raises(SystemExit, match=message):
        cli.check(args)


def test_the_report_states_the_set_up_and_the_verdict(tmp_path):
    rows = _rows([(1.0, 1.01), (1.0, 1.02), (1.0, 1.03)])
    result = {"rows": rows, "summary": summary.summarize(rows, block=20), "plan": {"reason": "static: none"},
              "steps": 60, "wire_bytes_total": 100, "dense_bytes_total": 100, "controller_outages": 0, "stats_dropped": 0}
    meta = {"command": "python -m jobs.bench overhead", "machine": {"cpu_model": "x", "logical_cores": 2},
            "seconds": 10.0, "batch": 32, "warmup_pairs": 0, "bucket_cap_mb": "auto"}
    json_path, md_path = write_report(result, meta, tmp_path, "overhead-test")
    assert json.loads(json_path.read_text())["summary"]["ratio_median"] == pytest.approx(1.02)
    text = md_path.read_text()
    assert "| 50.0 | 51.0 | 1.020 |" in text
    assert "Its steps" not in text  # a report from before the ways were counted says nothing of them
    result["ways"] = {"ddp": 60, "hook": 0}
    _, md_path = write_report(result, {**meta, "model": "lstm"}, tmp_path, "overhead-lstm")
    text = md_path.read_text()
    assert "Its steps: 60 by DDP's own reduction, 0 by raycomp's hook." \
        in text and "`jobs.models.char_lstm`" in text and "DDP's own all-reduce for the gradients" in text  # 1 s blocks of 20 steps and "**1.020** — **PASS**" in text


@pytest.mark.benchmark
def test_a_short_real_run_measures_both_sides_on_a_dense_plan(tmp_path):
    args = build_parser().parse_args(["overhead", "--pairs", "2", "--warmup-pairs", "1", "--block", "5",
                                      "--output-dir", str(tmp_path), "--name", "short"])
    assert cli.run(args, ["overhead", "--pairs", "2"]) == 0
    report = json.loads((tmp_path / "short.json").read_text())
    assert len(report["rows"]) == 3 and report["summary"]["pairs"] == 2
    assert report["steps"] == 15 and report["wire_bytes_total"] >= report["dense_bytes_total"] > 0
    assert report["controller_outages"] == 0
    assert all(r["plain_s"] > 0 and r["hook_s"] > 0 and r["raycomp_s"] > 0 for r in report["rows"])
    assert report["summary"]["hook_ratio_median"] > 0


def test_the_benchmark_is_registered():
    assert isinstance(build_parser().parse_args(["overhead"]), argparse.Namespace)


def test_raycomps_steps_are_told_apart_by_their_place_among_the_boundaries(tmp_path):
    # K = 10, an early boundary after 3 steps, agreements 2 steps after each: the report's
    # step (9, 19), the one after it (10), the agreement's (11), the rest; the warm-up left out
    seconds = {2: 0.9, 4: 0.9, 9: 0.022, 10: 0.025, 11: 0.023, 19: 0.024, 20: 0.027, 21: 0.021}
    records = [{"step": step, "seconds": seconds.get(step, 0.020)} for step in range(25)]
    places = summary.step_places(records, interval=10, first=3, agree_after=2, skip=5)
    assert places == pytest.approx({"boundary": 23.0, "after it": 26.0, "agreement": 22.0, "others": 20.0})
    # agreeing at the boundary itself (every_step): no step of its own
    same = summary.step_places(records, interval=10, first=None, agree_after=0, skip=0)
    assert set(same) == {"boundary", "after it", "others"} and same["after it"] == pytest.approx(26.0)
    rows = _rows([(1.0, 1.01)])
    result = {"rows": rows, "summary": summary.summarize(rows, block=20), "plan": {"reason": "static: none"},
              "steps": 20, "wire_bytes_total": 1, "dense_bytes_total": 1, "controller_outages": 0, "stats_dropped": 0}
    meta = {"command": "python -m jobs.bench overhead", "machine": {"cpu_model": "x", "logical_cores": 2},
            "seconds": 10.0, "batch": 32, "warmup_pairs": 0, "bucket_cap_mb": "auto"}
    for found, said in ((places, "boundary 23.0, after it 26.0, agreement 22.0, others 20.0. The boundary's step "
                                 "reports the statistics, the agreement's ends with the ranks' all-gather."),
                        (same, "The boundary's step reports the statistics and ends with the ranks' agreement")):
        _, md_path = write_report({**result, "step_places": found}, meta, tmp_path, "overhead-places")
        assert said in md_path.read_text() and "after its step's clock stops" not in md_path.read_text()
    _, md_path = write_report({**result, "step_places": places, "boundary_ms_per_step": 0.345}, meta,
                                       tmp_path, "overhead-places")
    assert "That work itself runs after its step's clock stops: 0.34 ms a step on average" in md_path.read_text()


def test_a_bf16_report_names_torchs_cast_hook_as_its_reference(tmp_path):
    rows = _rows([(1.0, 1.01), (1.0, 1.02), (1.0, 1.05)])
    s = summary.summarize(rows, block=20, plan="bf16")
    assert s["goal"] == "raycomp.train step with a bf16 plan <= 1.03x torch's bf16 hook's (median over block pairs)"
    result = {"rows": rows, "summary": s, "plan": {"reason": "static: bf16"}, "steps": 60,
              "wire_bytes_total": 5e5, "dense_bytes_total": 1e6, "controller_outages": 0, "stats_dropped": 0}
    meta = {"command": "python -m jobs.bench overhead --plan bf16 --workers 4",
            "machine": {"cpu_model": "x", "logical_cores": 2}, "seconds": 5.0, "batch": 32, "warmup_pairs": 3,
            "bucket_cap_mb": "auto", "plan": "bf16", "workers": 4}
    _, md_path = write_report(result, meta, tmp_path, "overhead-bf16")
    text = md_path.read_text()
    assert text.startswith("# The raycomp.train step on a bf16 plan against torch's bf16 hook")
    assert "| torch's bf16 hook step ms |" in text and "4 workers" in text
    assert "`default_hooks.bf16_compress_hook` registered" in text and "compressor `bf16`" in text


@pytest.mark.benchmark
def test_a_short_real_run_on_a_bf16_plan_sends_half_the_bytes(tmp_path):
    args = build_parser().parse_args(["overhead", "--plan", "bf16", "--pairs", "2",
                                      "--warmup-pairs", "1", "--block", "5", "--output-dir", str(tmp_path)])
    assert cli.run(args, ["overhead", "--plan", "bf16"]) == 0
    report = json.loads((tmp_path / "overhead-cnn-loopback-bf16.json").read_text())
    assert 0.45 * report["dense_bytes_total"] < report["wire_bytes_total"] < 0.6 * report["dense_bytes_total"]
    assert all(r["plain_s"] > 0 and r["hook_s"] > 0 and r["raycomp_s"] > 0 for r in report["rows"])
