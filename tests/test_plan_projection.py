"""``python -m jobs.plan``: the controller's adaptive policy projected onto W ranks and a
link this machine is not, on simulated intervals priced by the transports' traffic."""

from __future__ import annotations

import pytest

from jobs.plan import Setting, main, project

#: a matrix PowerSGD can shrink, and a large 1-D tensor only Top-K (an all-gather) or the
#: near-lossless rungs can
SHAPES = {"w": (1024, 1024), "v": (1 << 20,)}


def _settled(world: int, rate_bytes: float, lossy: str = "always") -> dict:
    return project(SHAPES, Setting(world, rate_bytes, compute=0.05, round_seconds=0.001, lossy=lossy))


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
