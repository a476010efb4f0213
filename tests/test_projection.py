"""``python -m jobs.projection``: the controller's adaptive policy projected onto W ranks and a
link this machine is not, on simulated intervals priced by the transports' traffic."""

from __future__ import annotations

import json
import math

import pytest

from jobs.projection import (
    DECODE_RATE_FALLBACK,
    KERNELS,
    Setting,
    default_decode_rate,
    main,
    project,
)

#: a matrix PowerSGD can shrink, and a large 1-D tensor only Top-K (an all-gather) or the
#: near-lossless rungs can
SHAPES = {"w": (1024, 1024), "v": (1 << 20,)}


def _settled(world: int, rate_bytes: float, lossy: str = "always", decode_rate: float | None = None) -> dict:
    return project(SHAPES, Setting(world, rate_bytes, compute=0.05, round_seconds=0.001, lossy=lossy,
                                   decode_rate=decode_rate))


def test_on_a_slow_link_two_ranks_take_top_k_for_the_vector_and_many_ranks_leave_it():
    """Top-K's all-gather grows with W-1 while int4's all-reduce-shaped route does not: at
    two ranks the vector goes on Top-K, at 512 on an all-reduce-compatible rung."""
    few = _settled(2, 12.5e6)
    assert few["plan"].spec_for("v").name == "topk", few["plan"]
    many = _settled(512, 12.5e6)
    assert many["plan"].spec_for("v").name in ("int4", "int8", "bf16"), many["plan"]
    assert many["plan"].spec_for("w").name == "powersgd", many["plan"]
    assert few["gain"] > 1.5 and many["gain"] > 1.5


def test_a_fast_link_stays_dense_and_an_adam_run_gets_no_lossy_rung():
    fast = _settled(64, 50e9)
    assert fast["plan"].summary(list(SHAPES)) == "dense", fast["plan"]
    assert fast["gain"] == pytest.approx(1.0)
    adam = _settled(4, 12.5e6, lossy="never")
    assert {adam["plan"].spec_for(n).name for n in SHAPES} <= {"int4", "int8", "bf16", "none"}, adam["plan"]


def test_a_slow_decode_moves_the_vector_off_top_k_and_prices_its_candidates_dearer():
    """An all-gather's decode of W payloads: at W = 8 a fast decode leaves the vector on
    Top-K, a slow one moves it to an all-reduce-compatible rung; at W = 256, where Top-K has
    lost on bytes already, the candidate that keeps it is predicted W payloads' decode
    slower."""
    fast, slow = _settled(8, 12.5e6, decode_rate=1e9), _settled(8, 12.5e6, decode_rate=1e6)
    assert fast["plan"].spec_for("v").name == "topk", fast["plan"]
    assert slow["plan"].spec_for("v").name in ("int4", "int8", "bf16"), slow["plan"]
    assert slow["chosen_s"] > fast["chosen_s"]
    fast, slow = _settled(256, 12.5e6, decode_rate=1e9), _settled(256, 12.5e6, decode_rate=1e6)
    decode_s = 256 * math.ceil(0.01 * (1 << 20)) * 8 * (1 / 1e6 - 1 / 1e9)
    assert slow["predicted"][0] - fast["predicted"][0] == pytest.approx(decode_s, rel=0.01)


def test_the_decode_rate_defaults_to_top_k_s_benchmark_and_falls_back_without_it(tmp_path):
    """Top-K's payload bytes over its decompress seconds, the fastest of the sizes benchmarked."""
    rows = [r for r in json.loads(KERNELS.read_text()) if r["compressor"] == "topk"]
    largest = max(rows, key=lambda r: r["wire_bytes"] / r["decompress_s"])
    rate, source = default_decode_rate()
    assert rate == pytest.approx(largest["wire_bytes"] / largest["decompress_s"])
    assert source == f"topk at {largest['numel']:,} elements in kernels.json"
    assert default_decode_rate(tmp_path / "missing.json") == (DECODE_RATE_FALLBACK, "missing.json unreadable, "
                                                                                    "the fallback constant")


def test_a_bad_decode_rate_is_one_line_and_exit_2(capsys):
    for bad in ("slow", "0", "inf"):
        assert main(["--config", "jobs/configs/digits.yaml", "--workers", "4", "--link", "1gbit",
                     "--compute-ms", "10", "--decode-rate", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("python -m jobs.projection: --decode-rate:"), err


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["--config", "jobs/configs/digits.yaml", "--workers", "1", "--link", "1gbit",
                 "--compute-ms", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "python -m jobs.projection: --workers: must be 2 or more, got 1"
    assert main(["--config", "jobs/configs/digits.yaml", "--workers", "4", "--link", "fast",
                 "--compute-ms", "10"]) == 2
    assert "--link" in capsys.readouterr().err


def test_the_command_prints_the_choice_and_the_gain(capsys):
    assert main(["--config", "jobs/configs/digits.yaml", "--workers", "8", "--link", "10mbit",
                 "--compute-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "W=8, 10mbit per rank" in out and "chooses:" in out and "against dense" in out
    assert "all-gather decode at " in out and "elements in kernels.json)" in out


# --- the projection's step model against a report's measured steps ----------------------
def _report(tmp_path, world=4, methods=("dense", "raycomp_int4")):
    steps = {"dense": 0.5, "raycomp_int4": 0.2}
    report = {"workload": {"name": "mlp", "config": "jobs/configs/digits.yaml", "world_size": world},
              "topology": f"{world}x1", "link": {"measured_mbit_s": 80.0}, "no_comm_step_s": 0.1,
              "methods": [{"name": m, "step_s": steps[m]} for m in methods]}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(report))
    return report, path


def test_projection_check_prices_the_reports_static_plans_from_what_it_measured(tmp_path):
    from jobs import projection_check
    from jobs.projection import _workload

    report, _ = _report(tmp_path)
    rows = projection_check.check(report)
    assert [r[2] for r in rows[:2]] == ["dense (static)", "raycomp_int4 (static)"]
    shapes, _ = _workload("jobs/configs/digits.yaml")
    numel = sum(math.prod(s) for s in shapes.values())
    dense_ms = (0.1 + 2 * 3 / 4 * 4 * numel / 10e6) * 1e3  # the ring at W = 4 over 80 Mbit/s
    assert rows[0][3] == pytest.approx(dense_ms) and rows[0][4] == pytest.approx(500.0)
    assert rows[0][5] == pytest.approx(dense_ms / 500.0 - 1)
    assert rows[1][3] < rows[0][3] and rows[1][4] == pytest.approx(200.0)
    assert rows[2][2].startswith("the projection's choice") and rows[2][4] is None
    # at two ranks the ring moves (W-1)/W of what it moves at four, per byte: 1 against 1.5
    two = projection_check.check(_report(tmp_path, world=2)[0])
    assert (two[0][3] - 100.0) == pytest.approx((rows[0][3] - 100.0) / 1.5)
    assert [r[2] for r in projection_check.check(_report(tmp_path, methods=("dense",))[0])][:1] == ["dense (static)"]


def test_projection_check_prints_a_table_and_a_bad_report_is_one_line(tmp_path, capsys):
    from jobs import projection_check

    _, path = _report(tmp_path)
    assert projection_check.main([str(path)]) == 0
    assert "| mlp 4x1 | 4 | dense (static) |" in capsys.readouterr().out
    assert projection_check.main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m jobs.projection_check: ") and "\n" not in err
