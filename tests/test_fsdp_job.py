"""``scaling.strategy=fsdp``: the Ray Train job with FSDP2 on a real local Ray (2 workers,
gloo): the controller steers each unit's compressed reduce-scatter, every rank runs the
same plan, and a killed worker resumes bit for bit from a torch distributed checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.job_runs import last_checkpoint, train
from tests.support.step_logs import step_logs

#: the digits MLP's fully_shard units (nn.Sequential children 0, 2, 4); "4" (5,130 elements)
UNITS = {"0", "2", "4"}


def sharded_model(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model of a sharded checkpoint, read offline (no process group) from its DCP files."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{checkpoint.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "sharded", target)
    return torch.load(target, weights_only=False)["model"]


RESUME = ("scaling.strategy=fsdp", "compression.policy=static", "compression.warmup_steps=0",
          "workload.epochs=3", "compression.static.compressor={name: sign}", "checkpoint.every_steps=5")
#: trained in the session's shared fit (tests/support/runs_in_turn.py): the adaptive run, and the
#: resume test's uninterrupted reference (a long check)
IN_TURN = {"fsdp": ("scaling.strategy=fsdp", "compression.policy=adaptive", "compression.adaptive.bandwidth=12.5e6")}
LONG_IN_TURN = {"straight": RESUME}


def test_fsdp_adaptive_run_compresses_each_unit_on_a_slow_link_and_keeps_accuracy(in_turn):
    summary = in_turn["fsdp"]
    assert summary["status"] == "succeeded"
    logs = step_logs(Path(summary["output_dir"]))
    assert len(logs) == 2
    for mine, theirs in zip(*logs, strict=True):
        assert (mine["plan_version"], mine["plan_digest"]) == (theirs["plan_version"], theirs["plan_digest"])
    # the warm-up (10 steps) times the link on the early first interval (steps 0-2,
    # controller.first_interval_steps), then sends the near-lossless rungs, from the same step
    # on both ranks: measured from step 5 (s + 3 for a plan decided after step s); from step 7
    # when the link was timed by the first K = 5 steps
    first = [next(r["step"] for r in records if not r["dense"]) for records in logs]
    assert first[0] == first[1] and first[0] <= 6, first
    layers = {name: spec["name"] for name, spec in summary["final_plan"]["layers"].items()}
    assert layers and set(layers) <= UNITS, layers  # the plan names units, not parameters
    assert set(layers.values()) <= {"int4", "int8", "bf16"}, layers  # what a reduce-scatter row carries
    # every unit stays critical on this short run (Accordion's rule: light compression) from
    # the warm-up's choice at step 2: int4 where the link is slow against the measured
    # compute, int8 where the machine is slow enough that 12.5 MB/s counts as fast; either
    # stays under the bound (bf16 for critical units would not: docs/benchmarks/history.md)
    assert summary["wire_bytes_total"] < 0.4 * summary["dense_bytes_total"]
    assert summary["plan_switches"] >= 1
    assert summary["final_eval_accuracy"] >= 0.9  # dense DDP: 0.930 on this job


@pytest.mark.long  # minutes of a real cluster: scripts/long-checks.sh, result in docs/testing.md
def test_fsdp_killed_worker_resumes_bit_for_bit_from_a_distributed_checkpoint(in_turn, tmp_path):
    # sign keeps an error-feedback residual per unit: resume must restore it exactly too
    reference = in_turn["straight"]
    crashed = train(tmp_path, "killed", *RESUME, "faults.kill_rank_at_step=27", "faults.kill_rank=1")
    assert crashed["status"] == reference["status"] == "succeeded"
    assert crashed["restored_from_step"] == 25
    assert crashed["steps"] == reference["steps"] == 66
    for records in step_logs(Path(crashed["output_dir"])):
        assert [r["step"] for r in records] == list(range(66))
    ref_dir, crash_dir = (last_checkpoint(s) for s in (reference, crashed))
    a, b = sharded_model(ref_dir, tmp_path), sharded_model(crash_dir, tmp_path)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    for rank in (0, 1):
        ra, rb = (torch.load(d / f"rank{rank}.pt", weights_only=False)["compression"] for d in (ref_dir, crash_dir))
        assert ra["comms"].keys() == rb["comms"].keys() == UNITS
        for unit in UNITS:
            residual_a, residual_b = ra["comms"][unit]["residual"], rb["comms"][unit]["residual"]
            assert residual_a is not None and torch.equal(residual_a, residual_b)
        assert ra["step"] == rb["step"] == 66
    assert crashed["final_eval_accuracy"] == reference["final_eval_accuracy"]
    assert reference["wire_bytes_total"] < 0.1 * reference["dense_bytes_total"]  # sign: 1 bit of 32


@pytest.mark.parametrize("override, message", [
    ("compression.policy=critical", r"^compression\.policy: 'critical' chooses Top-K"),
    ("compression.static.compressor={name: topk, ratio: 0.01}",
     r"^compression\.static\.compressor: 'topk' cannot compress a reduce-scatter shard; allowed with "
     r"scaling\.strategy=fsdp: none, bf16, fp16, int4, int8, qsgd, sign, terngrad"),
    ("compression.memory=dgc", r"^compression\.memory: 'dgc' is not available"),
])
def test_fsdp_refuses_what_a_sharded_reduce_scatter_cannot_carry_before_ray_starts(tmp_path, override, message):
    from jobs.config import ConfigError
    from jobs.train import prepare

    policy = ["compression.policy=static" if "static" in override else "compression.policy=adaptive"]
    with pytest.raises(ConfigError, match=message):
        prepare(["--config", str(Path(__file__).parents[1] / "jobs" / "configs" / "digits.yaml"),
                 "--output", str(tmp_path), "scaling.strategy=fsdp", *policy, override])


def test_train_options_check_the_strategy_as_job_configs_do():
    from jobs.config import ConfigError, validate
    from raycomp.config import CompressionSection
    from raycomp.train import TrainOptions

    assert TrainOptions(strategy="fsdp").strategy == "fsdp"  # the default policy (adaptive) fits
    with pytest.raises(ValueError, match=r"^compression\.policy: 'critical' chooses Top-K"):
        TrainOptions(strategy="fsdp", compression=CompressionSection(policy="critical"))
    with pytest.raises(ConfigError, match=r"^benchmark\.baseline: 'torch_fsdp_bf16' needs scaling"):
        validate({"benchmark": {"baseline": "torch_fsdp_bf16"}})
    with pytest.raises(ConfigError, match=r"^benchmark\.baseline: 'torch_powersgd' is a DDP hook"):
        validate({"scaling": {"strategy": "fsdp"}, "benchmark": {"baseline": "torch_powersgd"}})
    assert TrainOptions(find_unused_parameters=True).find_unused_parameters
    with pytest.raises(ValueError, match=r"^find_unused_parameters: a DDP option; allowed with strategy='ddp' only"):
        TrainOptions(strategy="fsdp", find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"^find_unused_parameters: must be True or False, got 'yes'"):
        TrainOptions(find_unused_parameters="yes")
