"""The outage drill (``python -m jobs.bench outage``): its verdict, and (long) the drill
itself on the benchmark's two-namespace Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jobs.bench import outage
from tests.support.netns import needs_netns


def _run_dir(root: Path, name: str, steps: int, state: dict, summary: dict) -> dict:
    output = root / name
    (output / "steps").mkdir(parents=True)
    for rank in (0, 1):
        (output / "steps" / f"rank{rank}.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                                                    for s in range(steps)))
    checkpoint = output / "checkpoint_000003"
    checkpoint.mkdir()
    torch.save({"model": state["model"]}, checkpoint / "shared.pt")
    for rank in (0, 1):
        torch.save({"compression": state["residual"], "counters": {"outages": state["outages"]}},
                   checkpoint / f"rank{rank}.pt")
    return {"output": str(output), "exit_code": 0, "summary": {"status": "succeeded", "steps": steps, **summary},
            "cut_at_step": state.get("cut"), "cut_error": None}


def test_the_verdict_needs_a_resume_every_step_once_and_bit_identical_state(tmp_path):
    state = {"model": {"w": torch.arange(4.0)}, "residual": {"r": torch.ones(3)}, "outages": 0}
    reference = _run_dir(tmp_path, "ref", 40, state, {"final_eval_accuracy": 0.9})
    resumed = {**state, "outages": 3, "cut": 26}  # restart counters may differ
    good = _run_dir(tmp_path, "good", 40, resumed, {"final_eval_accuracy": 0.9, "restored_from_step": 25})
    verdict = outage.compare(reference, good)
    assert verdict["pass"], verdict["why"]
    assert verdict["why"].startswith("cut after step 26, resumed from step 25, 40 steps")

    off_by_one_bit = {**resumed, "model": {"w": torch.arange(4.0).nextafter(torch.tensor(9.0))}}
    bad = _run_dir(tmp_path, "bad", 40, off_by_one_bit, {"final_eval_accuracy": 0.9, "restored_from_step": 25})
    verdict = outage.compare(reference, bad)
    assert not verdict["pass"] and verdict["differences"] == ["shared.pt:/model/w"]

    never_failed = _run_dir(tmp_path, "calm", 40, resumed, {"final_eval_accuracy": 0.9})
    assert "no worker-group restart" in outage.compare(reference, never_failed)["why"]

    replayed_twice = _run_dir(tmp_path, "gap", 40, resumed, {"final_eval_accuracy": 0.9, "restored_from_step": 25})
    (Path(replayed_twice["output"]) / "steps" / "rank1.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in [*range(27), *range(25, 40)]))
    assert "rank1.jsonl: steps missing or repeated" in outage.compare(reference, replayed_twice)["why"]


def test_bad_options_are_refused_before_any_namespace_exists(capsys):
    from jobs.bench.cli import main

    with pytest.raises(SystemExit, match="--modes: unknown"):
        main(["outage", "--modes", "sometimes"])
    with pytest.raises(SystemExit, match="--collective-timeout 20.0 must be below --seconds 15.0"):
        main(["outage", "--collective-timeout", "20"])


@needs_netns
@pytest.mark.long  # two Ray nodes, four digits runs, two 15 s cuts: scripts/long-checks.sh
def test_a_run_in_either_mode_survives_a_15_s_cut_of_the_link_and_loses_nothing(tmp_path):
    from jobs.bench.cli import main

    code = main(["outage", "--work-dir", str(tmp_path), "--output", str(tmp_path / "outage.json")])
    result = json.loads((tmp_path / "outage.json").read_text())
    print(json.dumps({m: r["why"] for m, r in result["modes"].items()}, indent=1))
    assert code == 0 and set(result["modes"]) == {"per_step", "local"}
    for mode in result["modes"].values():
        assert mode["pass"] and mode["restored_from_step"] < mode["cut_at_step"] + 1
