"""raycomp in PyTorch Lightning on a real local Ray (2 workers, gloo): ``RaycompStrategy`` in
place of Ray's ``RayDDPStrategy``, with Lightning's own loop, optimizer step, gradient
accumulation and precision plugins. Plan switches, a guard fallback and its recovery,
bytes checked at torch.distributed, a killed worker that resumes bit for bit, and the same
final loss as Lightning's own DDP within the spread of its seeds.

Each Ray Train fit costs ~20 s of start-up here, so one fit runs several Lightning fits
(each a fresh ``lightning.Trainer`` in the same workers) and the tests read its results."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from tests.support.framework_runs import assert_guard_run, fit_and_read  # noqa: E402
from tests.support.lightning_classifier import (  # noqa: E402
    Classifier,
    lightning_trainer,
    loaders,
    options,
    static,
)
from tests.support.step_logs import step_logs  # noqa: E402

GRADIENT_DTYPES = ("Float", "Half", "BFloat16", "Double")  # the flight recorder's names

NAN_STEP, STABLE, SWITCH = 9, 6, 14  # the guard's fit: NaN on rank 1, hysteresis, int8 from here


def topk(ratio: float, warmup: int = 0) -> dict:
    return static("topk", warmup, ratio=ratio)


def val_loss(trainer: pl.Trainer) -> float:
    return float(trainer.callback_metrics["val_loss"])


class Probe(pl.Callback):
    """After every optimizer step: the norms the guard judged and the statistics' norms
    (unscaled under a GradScaler, or they would be ~2**k times larger)."""

    def __init__(self, strategy) -> None:
        self.strategy, self.norms = strategy, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loop = self.strategy.loop
        self.norms.extend(loop.judge.guard.grad_norms)
        self.norms.extend(s.grad_norm for s in loop.state.stats if math.isfinite(s.grad_norm))


# --- one Ray fit, several Lightning fits ---------------------------------------------------------
def _train_func(config: dict) -> None:
    """The first attempt runs the fits the tests read and an uninterrupted reference, then
    the run whose rank 1 is killed; the restarted attempt resumes that run only."""
    import ray.train

    if ray.train.get_checkpoint() is None:
        _several_fits(config)
    _killed_and_resumed(config)


def _several_fits(config: dict) -> None:
    import ray.train
    from ray.train.lightning import RayDDPStrategy

    from raycomp.config import GuardSection, compressor
    from raycomp.controllers.policies import ScheduleOptions
    from raycomp.integrations.lightning import RaycompStrategy
    from tests.support.observed_strategy import observed_ddp_hook_strategy
    from tests.support.wire import WireRecorder

    rank = ray.train.get_context().get_world_rank()
    out: dict = {"seconds": {}}
    clock = time.perf_counter()

    # 1. the schedule policy (Top-K, int8 from SWITCH), NaN gradients on rank 1 at NAN_STEP
    schedule = ScheduleOptions(stages=[{"start_step": 0, "compressor": compressor("topk", ratio=0.1)},
                                       {"start_step": SWITCH, "compressor": compressor("int8")}])
    strategy = RaycompStrategy(options(config, "guard", policy="schedule", warmup_steps=0, schedule=schedule,
                                       guard=GuardSection(stable_steps=STABLE)),
                               monitor="val_loss", gradient_strategy=observed_ddp_hook_strategy)
    trainer = lightning_trainer(strategy, epochs=2)
    train, val = loaders()
    with WireRecorder() as wire:
        trainer.fit(Classifier(nan_at=NAN_STEP), train, val)
    loop = strategy.loop
    hook_group = str(loop.state.reducer.group.handle.group_name)
    out["guard"] = {**strategy.totals, "global_step": trainer.global_step, "val_loss": val_loss(trainer),
                    "after_optimizer_step": strategy.loop.strategy.calls,
                    "hook_bytes": sum(c.transmitted for c in wire.calls if c.group == hook_group),
                    "ledger_bytes": loop.state.ledger.wire_total,
                    "escaped": [m for m in wire.unrecorded() if m[0] == "gloo:all_reduce" and m[2] in GRADIENT_DTYPES],
                    "output_dir": loop.output_dir.as_posix(),
                    "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("raycomp/")}}

    out["seconds"]["guard"], clock = time.perf_counter() - clock, time.perf_counter()

    # 2. bf16 autocast, two micro-batches per optimizer step
    strategy = RaycompStrategy(options(config, "bf16", **topk(0.1)))
    trainer = lightning_trainer(strategy, epochs=2, precision="bf16-mixed", accumulate_grad_batches=2)
    trainer.fit(Classifier(), *loaders())
    out["bf16"] = {**strategy.totals, "global_step": trainer.global_step, "reductions": strategy.loop.state.step,
                   "batches": trainer.fit_loop.epoch_loop.batch_progress.total.completed,
                   "val_loss": val_loss(trainer), "output_dir": strategy.loop.output_dir.as_posix()}

    out["seconds"]["bf16"], clock = time.perf_counter() - clock, time.perf_counter()

    # 3. fp16 autocast with Lightning's GradScaler: 2**24 overflows, backs off, grows every 3 steps
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    strategy = RaycompStrategy(options(config, "fp16", **topk(0.05, warmup=2)))
    probe = Probe(strategy)
    trainer = lightning_trainer(strategy, epochs=2, callbacks=[probe],
                                plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Classifier(), *loaders())
    out["fp16"] = {**strategy.totals, "global_step": trainer.global_step, "scaler_is_the_loops": strategy.loop.grad_scaler is scaler,
                   "scale": scaler.get_scale(), "max_judged_norm": max(probe.norms), "val_loss": val_loss(trainer)}

    out["seconds"]["fp16"], clock = time.perf_counter() - clock, time.perf_counter()

    # 4. the final loss of Lightning's own DDP and of raycomp's int8, three seeds each
    out["metric"] = {"ddp": [], "raycomp": [], "ratio": []}
    for seed in range(3):
        trainer = lightning_trainer(RayDDPStrategy(), epochs=3)
        trainer.fit(Classifier(), *loaders(seed))
        out["metric"]["ddp"].append(val_loss(trainer))
        strategy = RaycompStrategy(options(config, f"seed{seed}", **static("int8")))
        trainer = lightning_trainer(strategy, epochs=3)
        trainer.fit(Classifier(), *loaders(seed))
        out["metric"]["raycomp"].append(val_loss(trainer))
        out["metric"]["ratio"].append(strategy.totals["dense_bytes_total"] / max(1.0, strategy.totals["wire_bytes_total"]))
    out["seconds"]["metric"] = time.perf_counter() - clock
    Path(config["output_dir"], f"rank{rank}.json").write_text(json.dumps(out, default=str))


@pytest.fixture(scope="module")
def fits(ray_cluster, tmp_path_factory):
    """Per rank: what :func:`_several_fits` and :func:`_killed_and_resumed` found."""
    return fit_and_read(_train_func, tmp_path_factory.mktemp("lightning"), "lightning")


@pytest.mark.long
def test_plans_switch_and_the_guard_falls_back_and_recovers_on_every_rank(fits):
    guard = fits[0]["guard"]
    logs = assert_guard_run(guard, NAN_STEP, STABLE, min_switches=2)
    assert 1.5 < logs[0][0]["loss"] < 4  # the step's loss as Lightning computed it (chance: ln 8 = 2.08)
    assert guard["val_loss"] < 1.0
    evals = [json.loads(line) for line in (Path(guard["output_dir"]) / "evals.jsonl").read_text().splitlines()]
    assert [(e["step"], e["val_loss"] > 0) for e in evals] == [(16, True), (32, True)]  # monitor="val_loss"
    # raycomp's values through the LightningModule's log, as the last step left them
    from raycomp.integrations.framework_step import LOGGED

    logged = guard["logged"]
    assert set(logged) == set(LOGGED), logged
    assert logged["raycomp/compression_ratio"] > 1  # Top-K, then int8
    assert logged["raycomp/plan_version"].is_integer() and logged["raycomp/plan_version"] >= 2
    assert logged["raycomp/fallbacks"] == 1 and logged["raycomp/fallback_active"] == 0  # recovered


@pytest.mark.long
def test_every_gradient_byte_went_through_raycomps_hook(fits):
    for rank in fits:
        guard = rank["guard"]
        # no gradient all-reduce that Python did not see (DDP's own, in C++); DDP's map of
        # used parameters (int32, with find_unused_parameters) would not count
        assert guard["escaped"] == []
        assert guard["hook_bytes"] == pytest.approx(guard["ledger_bytes"], rel=1e-9)
        assert guard["ledger_bytes"] > 0
    assert fits[0]["guard"]["wire_bytes_total"] < 0.6 * fits[0]["guard"]["dense_bytes_total"]


@pytest.mark.long
def test_the_framework_step_reaches_the_gradient_strategys_after_step_with_the_guards_verdict(fits):
    # one call per optimizer step, after that step's reduction: where local steps plug in
    calls = fits[0]["guard"]["after_optimizer_step"]
    assert calls == [[step + 1, step != NAN_STEP] for step in range(32)]


@pytest.mark.long
def test_bf16_with_gradient_accumulation_reduces_once_per_optimizer_step(fits):
    bf16 = fits[0]["bf16"]
    assert bf16["batches"] == 32 and bf16["global_step"] == bf16["steps"] == bf16["reductions"] == 16
    assert bf16["skipped_steps"] == 0 and bf16["wire_bytes_total"] < 0.5 * bf16["dense_bytes_total"]
    assert bf16["val_loss"] < 1.5
    first = json.loads((Path(bf16["output_dir"]) / "steps" / "rank0.jsonl").read_text().splitlines()[0])
    assert 1.5 < first["loss"] < 4  # both micro-batches' halves: the step's mean loss


@pytest.mark.long
def test_fp16_with_lightnings_scaler_skips_overflows_without_a_fallback(fits):
    fp16 = fits[0]["fp16"]
    assert fp16["scaler_is_the_loops"]
    assert fp16["loss_scale_overflows"] >= 1 and fp16["skipped_steps"] == fp16["loss_scale_overflows"]
    assert fp16["fallback_events"] == [] and fp16["scale"] < 2.0**24
    assert fp16["max_judged_norm"] < 100  # the guard and the controller saw unscaled gradients
    assert fp16["steps"] == 32 and fp16["val_loss"] < 1.5


@pytest.mark.long
def test_the_final_loss_matches_lightnings_own_ddp_within_its_seeds(fits):
    metric = fits[0]["metric"]
    ddp, raycomp = metric["ddp"], metric["raycomp"]
    spread = max(ddp) - min(ddp)
    assert abs(statistics.mean(raycomp) - statistics.mean(ddp)) <= max(spread, 0.02), metric
    assert min(metric["ratio"]) > 3  # int8 (~3.9x) from step 0: registering the run returns the plan


# --- a killed worker ------------------------------------------------------------------------
KILL_AT = 20  # global step, in the second epoch (an epoch is 16 steps)


class KillOnce(pl.Callback):
    """Rank 1 dies (``os._exit``: no cleanup, like a killed process) before global step
    ``KILL_AT``, once; a marker file remembers it across the restart."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == KILL_AT and trainer.global_rank == 1 and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(17)


def _weights_and_residuals(strategy) -> dict:
    module = strategy.lightning_module
    return {"weights": {k: v.clone() for k, v in module.state_dict().items()},
            "residuals": strategy.loop.state.state_dict()["memory"]["residuals"]}


def _killed_and_resumed(config: dict) -> None:
    """Top-K 5% with error feedback, three epochs, Lightning's checkpoint at every epoch end
    (Ray's report callback); rank 1 dies in the second epoch, once."""
    import ray.train
    from ray.train.lightning import RayTrainReportCallback

    from raycomp.integrations.lightning import RaycompStrategy

    rank = ray.train.get_context().get_world_rank()
    output = Path(config["output_dir"])
    output.mkdir(parents=True, exist_ok=True)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:  # the first attempt: the uninterrupted reference first
        strategy = RaycompStrategy(options(config, "reference", **topk(0.05)))
        lightning_trainer(strategy, epochs=3).fit(Classifier(), *loaders())
        torch.save(_weights_and_residuals(strategy), output / f"reference{rank}.pt")
    strategy = RaycompStrategy(options(config, "killed", **topk(0.05)))
    trainer = lightning_trainer(strategy, epochs=3, callbacks=[RayTrainReportCallback(), KillOnce(output / "rank1-was-killed")])
    if checkpoint is None:
        trainer.fit(Classifier(), *loaders())
    else:
        with checkpoint.as_directory() as directory:
            trainer.fit(Classifier(), *loaders(), ckpt_path=os.path.join(directory, "checkpoint.ckpt"))
    reference = torch.load(output / f"reference{rank}.pt", weights_only=False)
    mine = _weights_and_residuals(strategy)
    result = {**strategy.totals, "resumed": checkpoint is not None,
              "same_weights": all(torch.equal(reference["weights"][k], v) for k, v in mine["weights"].items()),
              "same_residuals": reference["residuals"].keys() == mine["residuals"].keys() and all(
                  torch.equal(reference["residuals"][k], v) for k, v in mine["residuals"].items()),
              "residual_layers": len(mine["residuals"]), "output_dir": strategy.loop.output_dir.as_posix()}
    (output / f"killed{rank}.json").write_text(json.dumps(result, default=str))


@pytest.mark.long
def test_a_killed_worker_resumes_from_lightnings_checkpoint_with_raycomps_state(fits):
    for rank in fits:
        killed = rank["killed"]
        assert killed["marker"], "rank 1 was never killed"
        assert killed["resumed"] and killed["restored_from_step"] == 16  # the epoch-1 checkpoint
        assert killed["steps"] == 48
        assert killed["residual_layers"] >= 3  # Top-K's error feedback, restored on every rank
        assert killed["same_weights"] and killed["same_residuals"]  # bit for bit the uninterrupted run
    assert fits[0]["killed"]["replayed_steps"] >= 1  # rank 0 had logged steps past the checkpoint
    for records in step_logs(fits[0]["killed"]["output_dir"], ranks=2):
        assert [r["step"] for r in records] == list(range(48))


def test_the_strategy_logs_raycomps_values_through_the_lightning_module(tmp_path):
    """The strategy's callback logs :meth:`FrameworkStep.logged` with ``pl_module.log``:
    Lightning's own loop (one process, no Ray) has them in ``callback_metrics`` and hands
    them to its loggers."""
    from types import SimpleNamespace

    from raycomp.integrations.framework_step import LOGGED, FrameworkStep
    from raycomp.integrations.lightning import _StepCallback
    from tests.support.fake_loop import fake_loop

    steps = FrameworkStep(fake_loop(ratio=4.0, version=3))
    strategy = SimpleNamespace(loop=None, monitor=None, totals=None, finish=lambda: None,
                               steps=SimpleNamespace(before_optimizer_step=lambda: True, logged=steps.logged))
    train, _ = loaders()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, callbacks=[_StepCallback(strategy)],
                         logger=pl.loggers.CSVLogger(tmp_path), log_every_n_steps=1, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Classifier(), train_dataloaders=train)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert set(LOGGED) <= set(metrics), metrics
    assert metrics["raycomp/compression_ratio"] == 4.0 and metrics["raycomp/plan_version"] == 3.0
    assert metrics["raycomp/fallbacks"] == 1.0 and metrics["raycomp/fallback_active"] == 0.0
    logged = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    assert set(LOGGED) <= set(logged[0].split(",")) and len(logged) == 4  # a row per step


def test_options_a_framework_driven_step_cannot_honour_fail_in_one_line_before_ray_starts():
    from raycomp.config import CheckpointSection, CompressionSection, LrScalingSection
    from raycomp.integrations.lightning import RaycompStrategy
    from raycomp.train import TrainOptions

    with pytest.raises(ValueError, match=r"^checkpoint\.every_steps: RaycompStrategy checkpoints through "):
        RaycompStrategy(TrainOptions(checkpoint=CheckpointSection(every_steps=5)))
    with pytest.raises(ValueError, match=r"^compression\.lr_scaling\.enabled: .*allowed: False$"):
        RaycompStrategy(TrainOptions(compression=CompressionSection(lr_scaling=LrScalingSection(enabled=True))))
    with pytest.raises(ValueError, match=r"^ddp_options: 'process_group' is not an option raycomp passes to DDP; "
                                         r"allowed: .*bucket_cap_mb"):
        RaycompStrategy(ddp_options={"process_group": None})
