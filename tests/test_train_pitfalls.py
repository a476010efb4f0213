"""raycomp.train without silent pitfalls, on a real local Ray (2 workers, gloo): a user's own
``ray.train.Checkpoint`` given to ``report`` is kept beside raycomp's state and resumed
from; a scheduler steps per step or per epoch as ``scheduler_interval`` says, also across a
resume; ``step(clip_grad_norm=...)`` clips the gradient averaged over the ranks; a run
without the controller fails at ``prepare_model`` unless it opts in to dense training."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.controller_fit import fit_with_controller

EPOCHS, STEPS = 3, 4  # the checkpoint run: 12 steps, a crash after epoch 0
LR, GAMMA = 0.1, 0.5


def _user_checkpoint_then_crash(config: dict) -> dict:
    import ray.train

    import raycomp.train
    from raycomp.config import ControllerSection

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    options = raycomp.train.TrainOptions(controller=ControllerSection(name=config["controller"], interval_steps=2),
                                         output_dir=config["output_dir"])
    model = raycomp.train.prepare_model(model, optimizer, scheduler, options=options, scheduler_interval="epoch")
    loop = raycomp.train.current()
    out: dict = {"restored_from": loop.restored_from, "lrs": []}
    if loop.restored_from is not None:  # what the restarted worker finds: the user's file and raycomp's
        with ray.train.get_checkpoint().as_directory() as directory:
            out["restored_files"] = sorted(p.name for p in Path(directory).iterdir())
            out["user_text"] = (Path(directory) / "user.txt").read_text()
        out["restored_last_epoch"], out["restored_lr"] = scheduler.last_epoch, optimizer.param_groups[0]["lr"]
    gen = torch.Generator().manual_seed(rank)
    for epoch in loop.epochs(EPOCHS, STEPS):
        for _ in range(loop.step_in_epoch, STEPS):
            out["lrs"].append(optimizer.param_groups[0]["lr"])
            loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
            loss.backward()
            raycomp.train.step(loss, samples=8)
        if epoch == 0 and rank == 0:  # refused before anything is recorded, reported or collective
            with pytest.raises(TypeError, match=r"^report: checkpoint must be True, False, None or a "
                                                r"ray\.train\.Checkpoint, got str$"):
                raycomp.train.report({}, checkpoint="yes")  # type: ignore[arg-type]
            with tempfile.TemporaryDirectory() as clash:
                (Path(clash) / "meta.json").write_text("{}")
                with pytest.raises(ValueError, match=r"^report: the checkpoint's files \['meta\.json'\] have the "
                                                     r"names of raycomp's own"):
                    raycomp.train.report({}, checkpoint=ray.train.Checkpoint.from_directory(clash))
        with tempfile.TemporaryDirectory() as mine:  # as with ray.train.report: rank 0's own files
            (Path(mine) / "user.txt").write_text(f"epoch {epoch}")
            (Path(mine) / "weights").mkdir()
            (Path(mine) / "weights" / "head.txt").write_text("head")
            # the other rank passes None, and the rule (the last epoch only) says no checkpoint
            # in epoch 0: every rank still writes its state, since rank 0 asked for one
            raycomp.train.report({"loss": float(loss)},
                                 checkpoint=ray.train.Checkpoint.from_directory(mine) if rank == 0 else None)
            assert sorted(p.name for p in Path(mine).iterdir()) == ["user.txt", "weights"]  # left as it was
        if epoch == 0 and loop.restored_from is None:
            raise RuntimeError("injected: the worker dies after the epoch-0 checkpoint")
    out["last_epoch"], out["lr"] = scheduler.last_epoch, optimizer.param_groups[0]["lr"]
    return {**raycomp.train.finish(), **out}


@pytest.fixture(scope="module")
def resumed(ray_cluster, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("own-ckpt")
    totals = fit_with_controller(_user_checkpoint_then_crash, tmp_path, "own-ckpt", max_failures=1)
    run_dir = tmp_path / f"own-ckpt-{tmp_path.name}"[:60]  # RunConfig(name=...) of fit_with_controller
    checkpoints = {json.loads((p / "meta.json").read_text())["global_step"]: p
                   for p in run_dir.glob("checkpoint_*") if (p / "meta.json").exists()}
    return totals, checkpoints


def test_report_keeps_a_users_checkpoint_with_raycomps_state_and_a_resume_reads_both(resumed):
    totals, checkpoints = resumed
    assert sorted(checkpoints) == [4, 8, 12]  # each epoch's: rank 0 passed its own every epoch
    files = sorted(p.name for p in checkpoints[4].iterdir())
    assert files == ["meta.json", "rank0.pt", "rank1.pt", "shared.pt", "user.txt", "weights"]
    assert (checkpoints[4] / "user.txt").read_text() == "epoch 0"
    assert (checkpoints[4] / "weights" / "head.txt").read_text() == "head"
    # the restarted worker resumed from that checkpoint: raycomp's state and the user's file
    assert totals["restored_from"] == totals["restored_from_step"] == 4 and totals["steps"] == 12
    assert totals["restored_files"] == files and totals["user_text"] == "epoch 0"


def test_an_epoch_scheduler_steps_at_each_epoch_end_and_resumes_where_the_checkpoint_left_it(resumed):
    totals, _ = resumed
    # restored as stepped at epoch 0's end (before its report checkpointed), not one behind
    assert (totals["restored_last_epoch"], totals["restored_lr"]) == (1, pytest.approx(LR * GAMMA))
    # the resumed attempt trained epochs 1 and 2: each at its own rate, constant within it
    assert totals["lrs"] == [pytest.approx(LR * GAMMA ** e) for e in (1, 2) for _ in range(STEPS)]
    assert (totals["last_epoch"], totals["lr"]) == (EPOCHS, pytest.approx(LR * GAMMA ** EPOCHS))


def test_a_scheduler_needs_its_interval_and_clip_grad_norm_a_positive_norm():
    import raycomp.train
    from raycomp._internal.train.step_arguments import check_clip

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    for interval in (None, "batch"):  # refused before anything talks to Ray
        with pytest.raises(ValueError, match=rf"^scheduler_interval: must be 'step' or 'epoch' when a scheduler "
                                             rf"is given, got {interval!r}$"):
            raycomp.train.prepare_model(model, optimizer, scheduler, scheduler_interval=interval)  # type: ignore
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match=r"^clip_grad_norm: must be a positive finite number or None, got "):
            check_clip(bad)
    check_clip(None)
    check_clip(1)
    check_clip(0.5)


# --- no controller; clipping the averaged gradient ------------------------------------------
MAX_NORM, STEPS_NO_CONTROLLER, LR_NO_CONTROLLER = 0.05, 6, 1.0


def _without_controller(config: dict) -> dict:
    import ray.train
    import torch.distributed as dist

    import raycomp.train
    from raycomp.config import ControllerSection

    rank = ray.train.get_context().get_world_rank()
    out: dict = {}
    options = raycomp.train.TrainOptions(controller=ControllerSection(name=config["controller"], interval_steps=2),
                                         output_dir=config["output_dir"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR_NO_CONTROLLER)
    try:
        raycomp.train.prepare_model(model, optimizer, options=options)
    except RuntimeError as error:
        out["error"] = str(error)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("raycomp.train").addHandler(handler)
    options = raycomp.train.TrainOptions(
        controller=ControllerSection(name=config["controller"], interval_steps=2, required=False),
        output_dir=config["output_dir"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    # a GradScaler: raycomp clips after unscaling (clipping the scaled gradient would clip x1024)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    ddp = raycomp.train.prepare_model(model, optimizer, scheduler, grad_scaler=scaler, options=options,
                                      scheduler_interval="step")
    loop = raycomp.train.current()
    module = ddp.module
    differs = []
    for epoch in loop.epochs(2, STEPS_NO_CONTROLLER // 2):
        for step in range(loop.step_in_epoch, STEPS_NO_CONTROLLER // 2):
            gen = torch.Generator().manual_seed(100 * rank + 10 * epoch + step)
            x = torch.randn(8, 16, generator=gen) * (1 + 3 * rank)  # gradients of unlike norms
            # this rank's own gradient, on a copy, and every rank's (collectives before DDP's)
            twin = copy.deepcopy(module)
            twin(x).pow(2).mean().backward()
            local = torch.cat([p.grad.flatten() for p in twin.parameters()])
            gathered = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(gathered, local)
            mean = torch.stack(gathered).mean(0)
            clipped_mean = mean * min(1.0, MAX_NORM / (float(mean.norm()) + 1e-6))
            mean_of_clipped = torch.stack([g * min(1.0, MAX_NORM / (float(g.norm()) + 1e-6))
                                           for g in gathered]).mean(0)
            before = torch.cat([p.detach().flatten() for p in module.parameters()])
            lr = optimizer.param_groups[0]["lr"]
            loss = ddp(x).pow(2).mean()
            scaler.scale(loss).backward()
            assert raycomp.train.step(loss, samples=8, clip_grad_norm=MAX_NORM)
            after = torch.cat([p.detach().flatten() for p in module.parameters()])
            update = (before - after) / lr
            assert float((update - clipped_mean).norm() / clipped_mean.norm()) < 1e-4
            differs.append(float((update - mean_of_clipped).norm() / mean_of_clipped.norm()))
            everyone = [torch.empty_like(after) for _ in range(2)]
            dist.all_gather(everyone, after)
            assert torch.equal(everyone[0], everyone[1]), "the ranks' weights differ"
            out.setdefault("norms", []).append(float(mean.norm()))
        raycomp.train.report({})
    logging.getLogger("raycomp.train").removeHandler(handler)
    out.update(differs=differs, warnings=records, last_epoch=scheduler.last_epoch,
               lr=optimizer.param_groups[0]["lr"])
    totals = raycomp.train.finish()
    # a second run in this function: an epoch scheduler, but no loop.epochs(...) to say where
    # epochs end. Its first step fails before it finishes the reduction (no silent per-step
    # or never-stepping scheduler)
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    options = dataclasses.replace(options, output_dir=f"{config['output_dir']}-epoch")  # its own step logs
    ddp = raycomp.train.prepare_model(model, optimizer, scheduler, options=options, scheduler_interval="epoch")
    loss = ddp(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    try:
        raycomp.train.step(loss, samples=8)
    except RuntimeError as error:
        out["epoch_error"] = str(error)
    out["epoch_scheduler_stepped"] = scheduler.last_epoch
    return {**totals, **out}


@pytest.fixture(scope="module")
def without_controller(ray_cluster, tmp_path_factory):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tmp_path = tmp_path_factory.mktemp("no-ctl")
    name = f"no-ctl-{tmp_path.name}"[:60]  # no service of this name: no ControllerCallback
    trainer = TorchTrainer(_without_controller,
                           train_loop_config={"controller": name, "output_dir": str(tmp_path / "out")},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name=name, storage_path=str(tmp_path)))
    return name, trainer.fit().return_value, tmp_path / "out"


def test_without_the_controller_callback_prepare_model_fails_naming_the_fix(without_controller):
    name, totals, _ = without_controller
    assert totals["error"] == (
        f"no controller service {name!r} (namespace 'raycomp'): add "
        "RunConfig(callbacks=[raycomp.train.ControllerCallback()]) with the same ControllerSection name as "
        "TrainOptions.controller, or set ControllerSection(required=False) to train dense without a controller")


def test_a_run_that_opts_out_of_the_controller_trains_dense_throughout_and_says_so(without_controller):
    name, totals, output = without_controller
    said = [w for w in totals["warnings"] if "no controller service" in w]
    assert said == [f"no controller service {name!r} and controller.required=False: this run trains dense, "
                    "uncompressed, for its whole length"]
    assert not any("warm-up" in w for w in totals["warnings"])
    assert totals["steps"] == STEPS_NO_CONTROLLER and totals["skipped_steps"] == 0
    assert totals["final_plan"]["reason"] == "no controller: dense" and totals["plan_switches"] == 0
    assert totals["wire_bytes_total"] >= totals["dense_bytes_total"] > 0  # nothing saved
    for rank in (0, 1):
        steps = [json.loads(line) for line in (output / "steps" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == list(range(STEPS_NO_CONTROLLER)) and all(s["dense"] for s in steps)


def test_a_step_scheduler_steps_after_every_step(without_controller):
    _, totals, _ = without_controller
    assert (totals["last_epoch"], totals["lr"]) == (STEPS_NO_CONTROLLER,
                                                    pytest.approx(LR_NO_CONTROLLER * 0.9 ** STEPS_NO_CONTROLLER))


def test_an_epoch_scheduler_without_loop_epochs_fails_at_the_first_step(without_controller):
    _, totals, _ = without_controller
    assert totals["epoch_error"] == (
        "scheduler_interval='epoch': raycomp knows where epochs end only from loop.epochs(epochs, steps_per_epoch); "
        "iterate that, or pass scheduler_interval='step'")
    assert totals["epoch_scheduler_stepped"] == 0


def test_clip_grad_norm_clips_the_gradient_averaged_over_the_ranks(without_controller):
    _, totals, _ = without_controller
    # the update checked on every rank against clip_grad_norm_ of the averaged gradient (the
    # ranks' weights equal after each step); here: that clipping did bite, and that clipping
    # each rank's own gradient before averaging would have given another update
    assert min(totals["norms"]) > 2 * MAX_NORM
    assert min(totals["differs"]) > 0.05
