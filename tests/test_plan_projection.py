"""``python -m jobs.plan``: the controller's adaptive policy projected onto W ranks and a
link this machine is not, on simulated intervals priced by the transports' traffic."""

from __future__ import annotations

import json
import math

import pytest

from jobs.plan import DECODE_RATE_FALLBACK, KERNELS, Setting, default_decode_rate, main, project

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
        assert err.count("\n") == 1 and err.startswith("python -m jobs.plan: --decode-rate:"), err


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["--config", "jobs/configs/digits.yaml", "--workers", "1", "--link", "1gbit",
                 "--compute-ms", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "python -m jobs.plan: --workers: must be 2 or more, got 1"
    assert main(["--config", "jobs/configs/digits.yaml", "--workers", "4", "--link", "fast",
                 "--compute-ms", "10"]) == 2
    assert "--link" in capsys.readouterr().err


def test_the_command_prints_the_choice_and_the_gain(capsys):
    assert main(["--config", "jobs/configs/digits.yaml", "--workers", "8", "--link", "10mbit",
                 "--compute-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "W=8, 10mbit per rank" in out and "chooses:" in out and "against dense" in out
    assert "all-gather decode at " in out and "elements in kernels.json)" in out
