"""A new user's mistakes that used to pass silently (issue 85): options given as plain dicts
and bad option values (one line naming the key), a model already wrapped in DDP (refused),
``ray.train.report(..., checkpoint=...)`` instead of raycomp's (warned once, on the Ray Train
controller) and a training function without ``raycomp.train.finish()`` (warned, and the run
finished for it: ``summary.json`` is written). The last two in one small 2-worker run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import raycomp.train
from raycomp.config import CheckpointSection, CompressionSection, ControllerSection, GuardSection
from raycomp.config.policy_options import AdaptiveOptions, StaticOptions
from raycomp.train import TrainOptions
from tests.support.ray_env import RAY_TEST_ENV

# --- options: plain dicts at every level, one-line errors ---------------------------------


def test_option_sections_may_be_plain_dicts_at_every_level():
    options = TrainOptions(compression={"policy": "static", "warmup_steps": 5,
                                        "static": {"compressor": {"name": "topk", "ratio": 0.1}},
                                        "guard": {"loss_window": 30}, "adaptive": {"threshold": 0.7}},
                           controller={"interval_steps": 5}, checkpoint={"every_epochs": 2})
    assert isinstance(options.compression, CompressionSection)
    assert dict(options.compression.static.compressor.spec().params) == {"ratio": 0.1}
    assert options.compression.guard == GuardSection(loss_window=30)
    assert options.compression.adaptive.threshold == 0.7
    assert options.controller == ControllerSection(interval_steps=5)
    assert options.checkpoint == CheckpointSection(every_epochs=2)
    # the same as the classes, which TrainOptions' checks (strategy) see as such
    assert options == TrainOptions(
        compression=CompressionSection(policy="static", warmup_steps=5,
                                       static=StaticOptions(compressor={"name": "topk", "ratio": 0.1}),
                                       guard=GuardSection(loss_window=30), adaptive=AdaptiveOptions(threshold=0.7)),
        controller=ControllerSection(interval_steps=5), checkpoint=CheckpointSection(every_epochs=2))
    with pytest.raises(ValueError, match=r"^compression\.policy: 'critical' chooses Top-K"):
        TrainOptions(strategy="fsdp", compression={"policy": "critical"})


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TrainOptions(compression={"adaptive": {"treshold": 0.7}}), r"compression\.adaptive\.treshold: unknown key"),
    (lambda: TrainOptions(compression={"adaptive": {"threshold": "high"}}),
     r"compression\.adaptive\.threshold: Input should be a valid number.* \(got 'high'\)"),
    (lambda: TrainOptions(compression={"guard": {"loss_window": 1}}),
     r"compression\.guard\.loss_window: Input should be greater than or equal to 3 \(got 1\)"),
    (lambda: TrainOptions(controller={"interval_steps": 0}), r"controller\.interval_steps: .*\(got 0\)"),
    (lambda: TrainOptions(checkpoint=3), r"checkpoint: must be a CheckpointSection or a dict of its keys, got int"),
    # the classes built in Python: the same one line, the same dotted key
    (lambda: TrainOptions(compression=CompressionSection(adaptive={"treshold": 0.7})),
     r"compression\.adaptive\.treshold: unknown key"),
    (lambda: CompressionSection(warmup_steps=-1), r"compression\.warmup_steps: .*\(got -1\)"),
    (lambda: AdaptiveOptions(max_error=-1), r"compression\.adaptive\.max_error: .*\(got -1\)"),
    (lambda: GuardSection(spike_quantile=2), r"compression\.guard\.spike_quantile: .*\(got 2\)"),
    (lambda: ControllerSection(interval_steps="often"), r"controller\.interval_steps: .*\(got 'often'\)"),
])
def test_a_bad_option_is_one_line_naming_its_dotted_key(build, message):
    with pytest.raises(ValueError) as caught:
        build()
    assert "\n" not in str(caught.value), str(caught.value)
    assert caught.type.__name__ == "ConfigError"
    assert caught.match(f"^{message}$")


def test_the_quick_starts_report_keeps_its_own_epoch():
    """The quick start reports ``{"epoch": epoch, ...}`` without ``loop.epochs(...)``, where
    raycomp's epoch stays 0: the metrics' own epoch and step are kept, raycomp's added else."""
    from raycomp._internal.train.ray_report import report_metrics
    from raycomp._internal.wire.ledger import WireLedger

    ledger = WireLedger()
    ledger.add("w", 10.0, 40.0)
    assert report_metrics({"epoch": 2, "loss": 0.5}, 0, 300, ledger, 2) == {
        "epoch": 2, "step": 300, "loss": 0.5, "wire_bytes": 20.0, "dense_bytes": 80.0, "compression_ratio": 4.0}
    assert report_metrics({"step": 7}, 1, 300, ledger, 2)["step"] == 7
    assert report_metrics({"wire_bytes": 1}, 1, 300, ledger, 2)["wire_bytes"] == 20.0  # raycomp's own keys win


# --- a model wrapped before raycomp wraps it ---------------------------------------------


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group in this process (DDP and FSDP need one to be built)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def nothing_built(monkeypatch):
    """``prepare_model`` past its argument checks: recorded, instead of building the loop."""
    calls: list[torch.nn.Module] = []

    def start_loop(model, *args, **kwargs):
        calls.append(model)
        raise AssertionError("prepare_model went on to build the loop")

    monkeypatch.setattr(raycomp.train, "start_loop", start_loop)
    return calls


def test_a_model_already_in_ddp_is_refused_in_one_line_before_anything_is_built(one_rank_group, nothing_built):
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # what ray.train.torch.prepare_model returns
    for options in (None, TrainOptions(strategy="fsdp")):
        with pytest.raises(ValueError, match=r"^prepare_model: the model is already a DistributedDataParallel "
                                             r"\(from ray\.train\.torch\.prepare_model or DDP\(\.\.\.\)\); pass the "
                                             r"plain model: raycomp wraps it in DDP itself, with its hook$"):
            raycomp.train.prepare_model(ddp, torch.optim.SGD(model.parameters(), lr=0.1), options=options)
    assert nothing_built == []
    with pytest.raises(AssertionError, match="went on"):  # the plain model goes on
        raycomp.train.prepare_model(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert nothing_built == [model]


def test_a_model_sharded_with_fsdp_is_taken_by_the_fsdp_strategy_only(one_rank_group, nothing_built):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    sharded = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 2)))  # FSDP2: raycomp's fsdp path takes it
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^prepare_model: the model is sharded with fully_shard \(FSDP2\) and "
                                         r"strategy='ddp' would wrap it in DDP; pass TrainOptions\(strategy='fsdp'\)"):
        raycomp.train.prepare_model(sharded, optimizer)
    assert nothing_built == []
    with pytest.raises(AssertionError, match="went on"):
        raycomp.train.prepare_model(sharded, optimizer, options=TrainOptions(strategy="fsdp"))
    assert nothing_built == [sharded]
    # FSDP1 is built on an accelerator only: an instance left unbuilt stands for one here
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    for strategy in ("ddp", "fsdp"):
        with pytest.raises(ValueError, match=r"^prepare_model: the model is already wrapped in FSDP1's "
                                             r"FullyShardedDataParallel; pass the plain model"):
            raycomp.train.prepare_model(fsdp1, optimizer, options=TrainOptions(strategy=strategy))
    assert nothing_built == [sharded]


# --- ray.train.report with a checkpoint, and no finish(): one real run ------------------


@pytest.fixture(scope="module")
def forgetful_run(ray_cluster, tmp_path_factory):
    """The run of :func:`tests.support.first_contact.forgetful_train_func`: what fit()
    returned, the run's directory, its output directory, and the warnings."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tests.support.first_contact import RecordingCallback, forgetful_train_func, warnings_in

    tmp_path = tmp_path_factory.mktemp("first-contact")
    name = f"first-contact-{tmp_path.name}"[:60]
    callback = RecordingCallback(ControllerSection(name=name, metrics_enabled=False),
                                 log_file=str(tmp_path / "controller.warnings"))
    output = tmp_path / "out"
    trainer = TorchTrainer(
        forgetful_train_func, train_loop_config={"controller": name, "output_dir": str(output)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), callbacks=[callback],
                             worker_runtime_env={"env_vars": RAY_TEST_ENV}))
    result = trainer.fit()
    return {"return_value": result.return_value, "run_dir": tmp_path / name, "output": output,
            "controller": warnings_in(tmp_path / "controller.warnings"),
            "ranks": [warnings_in(Path(f"{output}-rank{r}.warnings")) for r in range(2)]}


def test_a_checkpoint_reported_through_ray_train_report_is_warned_once_naming_raycomps_call(forgetful_run):
    said = [line for line in forgetful_run["controller"] if "without raycomp's state" in line]
    assert len(said) == 1, forgetful_run["controller"]  # two such reports, one warning
    assert "Call raycomp.train.report(metrics, checkpoint=...) instead" in said[0]
    # it names the first of them (report 2), not raycomp's own checkpoint (report 0)
    own = [p for p in forgetful_run["run_dir"].glob("checkpoint_*") if (p / "meta.json").exists()]
    assert len(own) == 1 and sorted(p.name for p in own[0].iterdir()) == ["meta.json", "rank0.pt", "rank1.pt",
                                                                         "shared.pt"]
    named = Path(said[0].split("was reported (", 1)[1].split(")", 1)[0])
    assert named != own[0], "raycomp's own checkpoint was warned about"
    assert (named / "user.txt").read_text() == "report 2"


def test_a_training_function_without_finish_is_warned_and_its_summary_still_written(forgetful_run):
    assert forgetful_run["return_value"] == {"rank": 0}  # the run ended as the user wrote it
    said = [line for line in forgetful_run["ranks"][0] if "raycomp.train.finish() was not called" in line]
    assert len(said) == 1, forgetful_run["ranks"][0]
    assert "`return raycomp.train.finish()` on every rank" in said[0]
    assert not any("finish()" in line for line in forgetful_run["ranks"][1])  # rank 0 says it
    summary = json.loads((forgetful_run["output"] / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 4 and summary["world_size"] == 2
    assert summary["wire_bytes_total"] > 0  # both ranks' totals, summed as finish() sums them
