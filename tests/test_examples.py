"""The examples a user copies, run end to end through the public API only."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support.repo import REPO


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_resnet_on_ray_train(ray_cluster, tmp_path):
    example = _load("ray_train_resnet")
    totals = example.main(["--workers", "2", "--epochs", "2", "--steps-per-epoch", "15",
                           "--storage", str(tmp_path), "--name", f"resnet-{tmp_path.name}",
                           "--controller", f"example-{tmp_path.name}"[:60]])
    output = tmp_path / f"resnet-{tmp_path.name}"
    assert totals["steps"] == 30 and totals["skipped_steps"] == 0
    assert totals["accuracy"] > 0.3  # ten classes: chance is 0.1
    # the default policy decided at every boundary after the warm-up (on loopback it may
    # well choose dense: the link is fast)
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] == 30 and "control_overhead" in summary
    policy = summary["policy"]
    assert policy["name"] == "adaptive"
    decided = [step for step, _, _ in policy["policy_details"]["history"]]
    assert len(decided) >= 3 and set(decided) <= {4, 9, 14, 19, 24, 29}, decided
    # report() recorded each epoch's accuracy without a record_eval call, and the
    # controller received the last one: step 30 is also a boundary, so each rank sent that
    # interval again with epoch 1's evaluation
    evals = [json.loads(line) for line in (output / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [15, 30]
    assert evals[-1]["accuracy"] == totals["accuracy"]
    assert policy["eval_metric"] == pytest.approx(evals[-1]["accuracy"], abs=0.01)
    # one checkpoint, in the last epoch
    checkpoints = [p for p in output.glob("checkpoint_*") if p.is_dir()]
    assert [json.loads((p / "meta.json").read_text())["global_step"] for p in checkpoints] == [30]


def test_plain_ddp_hook_without_ray():
    result = subprocess.run([sys.executable, str(REPO / "examples" / "ddp_hook.py"), "--steps", "20"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    ratio = float(lines[-1].rsplit("compression ", 1)[1].rstrip("x"))
    assert ratio > 5  # PowerSGD rank 2 on 256x64 and 10x256 layers


def test_lightning_on_ray_train(ray_cluster, tmp_path):
    pytest.importorskip("lightning")
    example = _load("lightning_ray_train")
    name = f"lightning-{tmp_path.name}"
    # the default (adaptive) policy, planning for a 0.8 Mbit/s link: loopback is fast, and the
    # example's model is 20 KB, so only a slow link makes compressing it worth its rounds
    totals = example.main(["--workers", "2", "--epochs", "2", "--samples", "1920", "--precision", "bf16-mixed",
                           "--accumulate", "2", "--bandwidth", "1e5", "--storage", str(tmp_path), "--name", name,
                           "--controller", f"example-{tmp_path.name}"[:60]])
    # 1920 images / (2 ranks x 32) = 30 micro-batches an epoch, 2 per optimizer step: 15 steps
    assert totals["steps"] == 30 and totals["skipped_steps"] == 0
    assert totals["plan_switches"] >= 1  # the controller steered it off the dense warm-up
    assert totals["wire_bytes_total"] < totals["dense_bytes_total"]
    assert totals["val_accuracy"] > 0.3  # ten classes: chance is 0.1
    evals = [json.loads(line) for line in (tmp_path / name / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [15, 30] and all("val_accuracy" in e for e in evals)
    checkpoints = sorted(p for p in (tmp_path / name).glob("checkpoint_*") if p.is_dir())
    assert len(checkpoints) == 2  # RayTrainReportCallback's, one an epoch, each with raycomp's state beside
    assert {p.name for p in (checkpoints[-1] / "checkpoint.ckpt.raycomp").iterdir()} == {
        "rank0.pt", "rank1.pt", "meta.json"}
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["policy"]["name"] == "adaptive"
    details = summary["policy"]["policy_details"]
    assert details["bandwidth_assumed"] and details["bandwidth_bytes_per_s"] == 1e5, details
    assert details["lossy"] is True  # SGD: PowerSGD and Top-K are on the ladders
    assert summary["policy"]["reports"] > 0  # the workers' statistics reached the controller


def test_hugging_face_trainer_on_ray_train(ray_cluster, tmp_path):
    pytest.importorskip("transformers")
    example = _load("transformers_ray_train")
    name = f"transformers-{tmp_path.name}"
    # the default (adaptive) policy, planning for a 20 Mbit/s link (loopback is fast: dense would
    # rightly win there)
    totals = example.main(["--workers", "2", "--epochs", "2", "--sequences", "384", "--bf16", "--accumulate", "2",
                           "--bandwidth", "2.5e6", "--storage", str(tmp_path), "--name", name,
                           "--controller", f"example-{tmp_path.name}"[:60]])
    # 384 sequences / (2 ranks x 8) = 24 micro-batches an epoch, 2 per optimizer step: 12 steps
    assert totals["steps"] == 24 and totals["skipped_steps"] == 0
    assert totals["plan_switches"] >= 1  # the controller steered it off the dense warm-up
    assert totals["wire_bytes_total"] < totals["dense_bytes_total"]
    assert totals["eval_loss"] < 3.0  # chance: ln 64 = 4.16
    evals = [json.loads(line) for line in (tmp_path / name / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [12, 24] and all("eval_loss" in e for e in evals)
    checkpoints = sorted(p for p in (tmp_path / name).glob("checkpoint_*") if p.is_dir())
    assert len(checkpoints) == 2  # RayTrainReportCallback's, one an epoch, each with raycomp's state inside
    assert {p.name for p in (checkpoints[-1] / "checkpoint" / "raycomp").iterdir()} == {
        "rank0.pt", "rank1.pt", "meta.json"}
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["policy"]["name"] == "adaptive"
    details = summary["policy"]["policy_details"]
    assert details["bandwidth_assumed"] and details["bandwidth_bytes_per_s"] == 2.5e6, details
    # the Trainer's AdamW: no lossy rungs, so every compressed layer went near-lossless
    assert details["lossy"] is False, details
    plan = totals["final_plan"]
    compressors = {plan["default"]["name"]} | {spec["name"] for spec in plan["layers"].values()}
    assert compressors <= {"int4", "int8", "bf16", "none"}, plan
    assert summary["policy"]["reports"] > 0  # the workers' statistics reached the controller
