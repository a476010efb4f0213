"""raycomp in the Hugging Face Trainer on a real local Ray (2 workers, gloo): raycomp's
``prepare_trainer`` in place of Ray's, with the Trainer's own loop, optimizer step, gradient
accumulation and mixed precision. A two-layer GPT-2 built from its config class on
tokenizer-free sequences, nothing downloaded. Plan switches, a guard fallback and its
recovery, bytes checked at torch.distributed, a killed worker that resumes bit for bit,
the same final loss as the Trainer's own DDP within the spread of its seeds, and local steps
(``compression.local``) under the Trainer's own step.

Each Ray Train fit costs ~20 s of start-up here, so one fit runs several Trainers in the
same workers and the tests read its results."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.gpu.support import same_on_every_rank  # noqa: E402
from tests.support.framework_runs import assert_guard_run, fit_and_read  # noqa: E402
from tests.support.gpt2_trainer import BATCH, gpt2, hf_trainer, options, sequences, static  # noqa: E402
from tests.support.step_logs import step_logs  # noqa: E402

GRADIENT_DTYPES = ("Float", "Half", "BFloat16", "Double")  # the flight recorder's names

NAN_STEP, STABLE, SWITCH = 9, 6, 14  # the guard's run: NaN on rank 1, hysteresis, int8 from here
KILL_AT = 20  # global step, in the second epoch
LOCAL_H = 3  # the local-step run: a sync every 3 optimizer steps; the last of 16 falls between two


def eval_loss(trainer) -> float:
    return next(h["eval_loss"] for h in reversed(trainer.state.log_history) if "eval_loss" in h)


# --- one Ray fit, several Trainers -------------------------------------------------------------
def _train_func(config: dict) -> None:
    """The first attempt runs the Trainers the tests read and an uninterrupted reference,
    then the run whose rank 1 is killed; the restarted attempt resumes that run only."""
    import ray.train

    if ray.train.get_checkpoint() is None:
        _several_runs(config)
    _killed_and_resumed(config)


def _several_runs(config: dict) -> None:
    import ray.train
    from ray.train.huggingface.transformers import prepare_trainer as ray_prepare_trainer

    from raycomp.config import GuardSection, compressor
    from raycomp.controllers.policies import ScheduleOptions
    from raycomp.integrations.transformers import prepare_trainer
    from tests.support.observed_strategy import observed_ddp_hook_strategy
    from tests.support.wire import WireRecorder

    rank = ray.train.get_context().get_world_rank()
    work = config["output_dir"]
    out: dict = {}

    # 1. the schedule policy (Top-K, int8 from SWITCH), NaN gradients on rank 1 at NAN_STEP
    schedule = ScheduleOptions(stages=[{"start_step": 0, "compressor": compressor("topk", ratio=0.1)},
                                       {"start_step": SWITCH, "compressor": compressor("int8")}])
    trainer = prepare_trainer(
        hf_trainer(f"{work}/hf-guard", nan_at=NAN_STEP),
        options(config, "guard", policy="schedule", warmup_steps=0, schedule=schedule,
                guard=GuardSection(stable_steps=STABLE)),
        monitor="eval_loss", gradient_strategy=observed_ddp_hook_strategy)
    with WireRecorder() as wire:
        trainer.train()
    loop = trainer.raycomp.loop
    hook_group = str(loop.state.reducer.group.handle.group_name)
    out["guard"] = {**trainer.raycomp.totals, "global_step": trainer.state.global_step,
                    "eval_loss": eval_loss(trainer), "after_optimizer_step": loop.strategy.calls,
                    "logged": [{k: v for k, v in entry.items() if k.startswith("raycomp/") or k == "step"}
                               for entry in trainer.state.log_history if "raycomp/plan_version" in entry],
                    "hook_bytes": sum(c.transmitted for c in wire.calls if c.group == hook_group),
                    "ledger_bytes": loop.state.ledger.wire_total,
                    "escaped": [m for m in wire.unrecorded() if m[0] == "gloo:all_reduce" and m[2] in GRADIENT_DTYPES],
                    "output_dir": loop.output_dir.as_posix()}

    # 2. bf16 autocast, two micro-batches per optimizer step
    trainer = prepare_trainer(hf_trainer(f"{work}/hf-bf16", bf16=True, gradient_accumulation_steps=2),
                              options(config, "bf16", **static("topk", ratio=0.1)))
    trainer.train()
    out["bf16"] = {**trainer.raycomp.totals, "global_step": trainer.state.global_step,
                   "reductions": trainer.raycomp.loop.state.step, "eval_loss": eval_loss(trainer),
                   "output_dir": trainer.raycomp.loop.output_dir.as_posix()}

    # 3. fp16=True on CPU: accelerate runs no autocast and no GradScaler there (GPU only)
    trainer = prepare_trainer(hf_trainer(f"{work}/hf-fp16", fp16=True, epochs=1),
                              options(config, "fp16", **static("int8")))
    trainer.train()
    out["fp16"] = {**trainer.raycomp.totals, "global_step": trainer.state.global_step,
                   "scaler": trainer.accelerator.scaler is not None,
                   "loop_scaler": trainer.raycomp.loop.grad_scaler is not None, "eval_loss": eval_loss(trainer)}

    # 4. the final loss of the Trainer's own DDP and of raycomp's int8, three seeds each
    out["metric"] = {"ddp": [], "raycomp": [], "ratio": []}
    for seed in range(3):
        trainer = ray_prepare_trainer(hf_trainer(f"{work}/hf-ddp{seed}", seed=seed))
        trainer.train()
        out["metric"]["ddp"].append(eval_loss(trainer))
        trainer = prepare_trainer(hf_trainer(f"{work}/hf-seed{seed}", seed=seed),
                                  options(config, f"seed{seed}", **static("int8")))
        trainer.train()
        out["metric"]["raycomp"].append(eval_loss(trainer))
        totals = trainer.raycomp.totals
        out["metric"]["ratio"].append(totals["dense_bytes_total"] / max(1.0, totals["wire_bytes_total"]))

    # 5. local steps (compression.local.mode=fixed) under the Trainer's own optimizer step
    from raycomp.config import LocalSection

    trainer = prepare_trainer(hf_trainer(f"{work}/hf-local", epochs=1),
                              options(config, "local", **static("int8"),
                                      # each sync waited for at once: the replicas agree right after it
                                      local=LocalSection(mode="fixed", sync_every=LOCAL_H, compressor="int8",
                                                         delay=0)))
    agreement = Agreement()
    trainer.add_callback(agreement)  # after raycomp's callback, whose on_step_end syncs
    trainer.train()
    sync = trainer.raycomp.loop.strategy
    out["local"] = {**trainer.raycomp.totals, "equal": agreement.equal, "per_step": sync.per_step,
                    "outer_steps": sync.state.steps.outer_steps, "global_step": trainer.state.global_step}
    Path(work, f"rank{rank}.json").write_text(json.dumps(out, default=str))


class Agreement(transformers.TrainerCallback):
    """After every optimizer step: whether the two ranks hold the same weights."""

    def __init__(self) -> None:
        self.equal: list[bool] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.equal.append(same_on_every_rank(list(model.parameters())))


class KillOnce(transformers.TrainerCallback):
    """Rank 1 dies (``os._exit``: no cleanup, like a killed process) before global step
    ``KILL_AT``, once; a marker file remembers it across the restart."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == KILL_AT and args.process_index == 1 and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(17)


def _weights_and_residuals(trainer) -> dict:
    return {"weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "residuals": trainer.raycomp.loop.state.state_dict()["memory"]["residuals"]}


def _killed_and_resumed(config: dict) -> None:
    """Top-K 5% with error feedback, three epochs, the Trainer's checkpoint at every epoch end
    (reported by Ray's callback); rank 1 dies in the second epoch, once."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback

    from raycomp.integrations.transformers import prepare_trainer

    rank = ray.train.get_context().get_world_rank()
    work = Path(config["output_dir"])
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:  # the first attempt: the uninterrupted reference first
        trainer = prepare_trainer(hf_trainer(f"{work}/hf-reference", epochs=3),
                                  options(config, "reference", **static("topk", ratio=0.05)))
        trainer.train()
        torch.save(_weights_and_residuals(trainer), work / f"reference{rank}.pt")
    trainer = prepare_trainer(
        hf_trainer(f"{work}/hf-killed", epochs=3, save_strategy="epoch",
                   callbacks=[RayTrainReportCallback(), KillOnce(work / "rank1-was-killed")]),
        options(config, "killed", **static("topk", ratio=0.05)))
    if checkpoint is None:
        trainer.train()
    else:
        with checkpoint.as_directory() as directory:
            trainer.train(resume_from_checkpoint=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))
    reference, mine = torch.load(work / f"reference{rank}.pt", weights_only=False), _weights_and_residuals(trainer)
    result = {**trainer.raycomp.totals, "resumed": checkpoint is not None,
              "same_weights": all(torch.equal(reference["weights"][k], v) for k, v in mine["weights"].items()),
              "same_residuals": reference["residuals"].keys() == mine["residuals"].keys() and all(
                  torch.equal(reference["residuals"][k], v) for k, v in mine["residuals"].items()),
              "residual_layers": len(mine["residuals"]), "output_dir": trainer.raycomp.loop.output_dir.as_posix()}
    (work / f"killed{rank}.json").write_text(json.dumps(result, default=str))


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """Per rank: what :func:`_several_runs` and :func:`_killed_and_resumed` found."""
    return fit_and_read(_train_func, tmp_path_factory.mktemp("transformers"), "transformers")


@pytest.mark.long
def test_plans_switch_and_the_guard_falls_back_and_recovers_on_every_rank(runs):
    guard = runs[0]["guard"]
    logs = assert_guard_run(guard, NAN_STEP, STABLE, min_switches=1)
    assert 3 < logs[0][0]["loss"] < 5  # the step's loss as the Trainer computed it (chance: ln 64 = 4.16)
    assert guard["eval_loss"] < 2.5
    evals = [json.loads(line) for line in (Path(guard["output_dir"]) / "evals.jsonl").read_text().splitlines()]
    assert [(e["step"], e["eval_loss"] > 0) for e in evals] == [(16, True), (32, True)]  # monitor="eval_loss"
    # raycomp's values in the Trainer's log entries (here: its evaluations' at steps 16 and 32)
    from raycomp.integrations.framework_step import LOGGED

    assert [entry["step"] for entry in guard["logged"]][:2] == [16, 32], guard["logged"]
    for entry in guard["logged"]:
        assert set(entry) == {*LOGGED, "step"}
        assert entry["raycomp/compression_ratio"] > 1 and isinstance(entry["raycomp/plan_version"], int)
        assert entry["raycomp/fallbacks"] == 1  # the NaN at NAN_STEP
    assert guard["logged"][-1]["raycomp/fallback_active"] == 0  # recovered


@pytest.mark.long
def test_every_gradient_byte_went_through_raycomps_hook(runs):
    for rank in runs:
        guard = rank["guard"]
        # no gradient all-reduce that Python did not see (DDP's own, in C++); DDP's map of
        # used parameters (int32, find_unused_parameters, which the Trainer turns on) may pass
        assert guard["escaped"] == []
        assert guard["hook_bytes"] == pytest.approx(guard["ledger_bytes"], rel=1e-9)
        assert guard["ledger_bytes"] > 0
    assert runs[0]["guard"]["wire_bytes_total"] < 0.6 * runs[0]["guard"]["dense_bytes_total"]


@pytest.mark.long
def test_the_trainer_step_reaches_the_gradient_strategys_after_step_with_the_guards_verdict(runs):
    # one call per optimizer step, after that step's reduction: where local steps plug in
    calls = runs[0]["guard"]["after_optimizer_step"]
    assert calls == [[step + 1, step != NAN_STEP] for step in range(32)]


@pytest.mark.long
def test_bf16_with_gradient_accumulation_reduces_once_per_optimizer_step(runs):
    bf16 = runs[0]["bf16"]
    assert bf16["global_step"] == bf16["steps"] == bf16["reductions"] == 16  # 2 epochs of 16 batches, 2 a step
    assert bf16["skipped_steps"] == 0 and bf16["wire_bytes_total"] < 0.5 * bf16["dense_bytes_total"]
    assert bf16["eval_loss"] < 3.5
    first = json.loads((Path(bf16["output_dir"]) / "steps" / "rank0.jsonl").read_text().splitlines()[0])
    assert 3 < first["loss"] < 5  # both micro-batches' halves: the step's mean loss


@pytest.mark.long
def test_fp16_on_cpu_trains_without_a_scaler_as_accelerate_runs_it(runs):
    fp16 = runs[0]["fp16"]
    assert not fp16["scaler"] and not fp16["loop_scaler"]  # accelerate makes a GradScaler on GPUs only
    assert fp16["global_step"] == fp16["steps"] == 16 and fp16["skipped_steps"] == 0
    assert fp16["eval_loss"] < 3.5


@pytest.mark.long
def test_the_final_loss_matches_the_trainers_own_ddp_within_its_seeds(runs):
    metric = runs[0]["metric"]
    ddp, raycomp = metric["ddp"], metric["raycomp"]
    spread = max(ddp) - min(ddp)
    assert abs(statistics.mean(raycomp) - statistics.mean(ddp)) <= max(spread, 0.02), metric
    assert min(metric["ratio"]) > 3  # int8 (~3.9x) from step 0: registering the run returns the plan


@pytest.mark.long
def test_a_killed_worker_resumes_from_the_trainers_checkpoint_with_raycomps_state(runs):
    for rank in runs:
        killed = rank["killed"]
        assert killed["marker"], "rank 1 was never killed"
        assert killed["resumed"] and killed["restored_from_step"] == 16  # the epoch-1 checkpoint
        assert killed["steps"] == 48
        assert killed["residual_layers"] >= 3  # Top-K's error feedback, restored on every rank
        assert killed["same_weights"] and killed["same_residuals"]  # bit for bit the uninterrupted run
    assert runs[0]["killed"]["replayed_steps"] >= 1  # rank 0 had logged steps past the checkpoint
    for records in step_logs(runs[0]["killed"]["output_dir"], ranks=2):
        assert [r["step"] for r in records] == list(range(48))


@pytest.mark.long
def test_local_steps_under_the_trainer_leave_the_ranks_equal_after_every_sync_and_only_then(runs):
    local = runs[0]["local"]
    assert not local["per_step"] and local["global_step"] == local["steps"] == 16  # one epoch
    # one outer step every LOCAL_H steps and one more at the last step (the Trainer's max_steps),
    # which merges the replicas before the Trainer's last evaluation and save
    assert local["outer_steps"] == runs[1]["local"]["outer_steps"] == 16 // LOCAL_H + 1
    assert local["equal"] == [(step + 1) % LOCAL_H == 0 or step == 15 for step in range(16)]
    assert 0 < local["wire_bytes_total"] < 0.3 * local["dense_bytes_total"]  # int8 pseudo-gradients, every 3rd step


def test_what_raycomps_prepare_trainer_cannot_drive_fails_in_one_line(tmp_path):
    from raycomp.config import CheckpointSection
    from raycomp.integrations.transformers import prepare_trainer
    from raycomp.train import TrainOptions

    with pytest.raises(ValueError, match=r"^trainer: a transformers\.Trainer, got str$"):
        prepare_trainer("not a trainer")
    with pytest.raises(ValueError, match=r"^checkpoint\.every_steps: raycomp's prepare_trainer checkpoints "):
        prepare_trainer(hf_trainer(str(tmp_path)), TrainOptions(checkpoint=CheckpointSection(every_steps=5)))
    trainer = prepare_trainer(hf_trainer(str(tmp_path)))
    assert trainer.callback_handler.callbacks[0] is trainer.raycomp  # before RayTrainReportCallback's on_save
    assert trainer.accelerator.ddp_handler.bucket_cap_mb == 1.0  # raycomp's cap for a small model
    with pytest.raises(ValueError, match=r"^trainer: raycomp's prepare_trainer was applied to it already$"):
        prepare_trainer(trainer)


def test_every_entry_the_trainer_logs_while_training_has_raycomps_values(tmp_path):
    """The trainer class raycomp's ``prepare_trainer`` gives a Trainer adds
    :meth:`FrameworkStep.logged` to each entry of ``state.log_history`` (the Trainer's own
    loop, one process, no Ray; the step glue over a stand-in loop)."""
    from raycomp.integrations.framework_step import LOGGED, FrameworkStep, framework_strategy
    from raycomp.integrations.transformers import RaycompCallback, _with_raycomp
    from raycomp.train import TrainOptions
    from tests.support.fake_loop import fake_loop

    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                                               max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                                               disable_tqdm=True, use_cpu=True)
    trainer = transformers.Trainer(model=gpt2(), args=arguments, train_dataset=sequences(64, 0))
    trainer.__class__ = _with_raycomp(type(trainer))
    trainer.raycomp = RaycompCallback(trainer, TrainOptions(), None, framework_strategy)
    trainer.raycomp.steps = FrameworkStep(fake_loop(ratio=4.0, version=3))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3]
    for entry in steps:
        assert {key: entry[key] for key in LOGGED} == {"raycomp/compression_ratio": 4.0, "raycomp/plan_version": 3,
                                                     "raycomp/fallback_active": 0.0, "raycomp/fallbacks": 1}
