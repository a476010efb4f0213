"""raycomp.train with a GradScaler, on a real local Ray (2 workers, gloo): overflows are
skipped without a fallback to dense, the guard judges unscaled gradients (whether or not the
caller unscaled them first, to clip), and a restarted worker resumes the scaler where the
checkpoint left it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from jobs.train import Precision
from tests.support.controller_fit import fit_with_controller


def _train_with_a_scaler(config: dict) -> dict:
    import ray.train

    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection, compressor
    from raycomp.controllers.policies import StaticOptions

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.003)
    # fp16 autocast: at 2**24 the activations' gradients overflow fp16, the scaler backs off
    # until they fit, then grows every 3 steps and overflows again
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection(policy="static", warmup_steps=2,
                                       static=StaticOptions(compressor=compressor("topk", ratio=0.05))),
        controller=ControllerSection(name=config["controller"], interval_steps=2),
        output_dir=config["output_dir"])
    model = raycomp.train.prepare_model(model, optimizer, grad_scaler=scaler, options=options)
    loop = raycomp.train.current()
    saved = Path(config["output_dir"]) / "scale_at_checkpoint.json"
    resumed_scale = scaler.get_scale() if loop.restored_from is not None else None
    gen = torch.Generator().manual_seed(rank)
    norms = []
    for epoch in loop.epochs(2, 10):
        for _ in range(loop.step_in_epoch, 10):
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            scaler.scale(loss).backward()
            if loop.global_step % 2:  # torch's recipe for clipping: unscale first, then step
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 50.0)
            raycomp.train.step(loss, samples=len(y))
            norms.extend(loop.judge.guard.grad_norms)  # what the guard judged
            # what the controller is sent (an overflowed step's statistics are not finite: never sent)
            norms.extend(s.grad_norm for s in loop.state.stats if math.isfinite(s.grad_norm))
        raycomp.train.report({}, checkpoint=True)
        if epoch == 0 and loop.restored_from is None:
            if rank == 0:
                saved.write_text(json.dumps(scaler.get_scale()))
            raise RuntimeError("injected: the worker dies after the epoch-0 checkpoint")
    totals = raycomp.train.finish()
    return {**totals, "resumed_scale": resumed_scale, "saved_scale": json.loads(saved.read_text()),
            "max_judged_norm": max(norms)}


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_a_grad_scaler_trains_compressed_and_resumes_where_the_checkpoint_left_it(ray_cluster, tmp_path):
    totals = fit_with_controller(_train_with_a_scaler, tmp_path, "fp16", max_failures=1)
    assert totals["restored_from_step"] == 10 and totals["steps"] == 20
    # the restarted worker's scaler is the checkpoint's, not a fresh one at 2**24
    assert totals["resumed_scale"] == totals["saved_scale"] < 2.0**24
    # the first steps overflowed; each was skipped for the scaler, none made the guard fall back
    assert totals["loss_scale_overflows"] >= 1
    assert totals["skipped_steps"] == totals["loss_scale_overflows"]
    assert totals["fallback_events"] == []
    assert totals["max_judged_norm"] < 100  # the guard and the controller saw unscaled gradients
    assert totals["wire_bytes_total"] < 0.5 * totals["dense_bytes_total"]  # Top-K 5% after 2 dense steps


def test_a_grad_scaler_is_refused_where_raycomp_train_cannot_follow_it():
    import raycomp.train
    from raycomp._internal.train.scaler_check import refuse_scaler

    model, scaler = torch.nn.Linear(2, 2), torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"^grad_scaler: expected a torch.amp.GradScaler or None, got str$"):
        raycomp.train.prepare_model(model, None, grad_scaler="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^grad_scaler: not supported with strategy 'fsdp'; allowed there: None"):
        raycomp.train.prepare_model(model, None, grad_scaler=scaler,  # type: ignore[arg-type]
                                    options=raycomp.train.TrainOptions(strategy="fsdp"))
    # a disabled scaler (behind a flag) scales nothing: no reason to refuse it
    refuse_scaler(torch.amp.GradScaler("cpu", enabled=False), raycomp.train.TrainOptions(strategy="fsdp"))


@pytest.mark.parametrize("precision,dtype,scale", [("fp32", torch.float32, 1.0), ("bf16", torch.bfloat16, 1.0),
                                                   ("fp16", torch.float16, 2.0**16)])
def test_the_job_runs_the_forward_pass_in_its_precision(precision, dtype, scale):
    chosen = Precision(precision, "cpu")
    model = torch.nn.Linear(8, 4)
    with chosen.autocast():
        out = model(torch.randn(2, 8))
    assert out.dtype == dtype
    chosen.backward(out.float().mean())  # 8 outputs: 1/8 each, over 2 rows into the bias
    assert torch.equal(model.bias.grad, torch.full((4,), 0.25 * scale))  # fp16: the scaler's default scale


#: trained in the session's shared fit (tests/support/runs_in_turn.py)
IN_TURN = {"fp16": ("workload.epochs=1", "workload.precision=fp16")}


def test_a_job_in_fp16_trains_with_a_scaler_in_its_checkpoints(in_turn):
    summary = in_turn["fp16"]
    assert summary["status"] == "succeeded" and summary["final_eval_accuracy"] > 0.5  # fp32: 0.59 after 1 epoch
    own = torch.load(Path(summary["checkpoint"]) / "rank0.pt", weights_only=False)
    assert own["grad_scaler"]["scale"] == 2.0**16  # no overflow on digits: the default scale
