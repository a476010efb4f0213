"""The typed options of :func:`raycomp.train.prepare_model`, each with its default."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from raycomp.config import CheckpointSection, CompressionSection, ControllerSection
from raycomp.train.lossy import lossy_setting

__all__ = ["TrainOptions", "resolve_options"]


@dataclass(frozen=True)
class TrainOptions:
    """How raycomp steers one Ray Train run.

    Args:
        compression: the policy the controller runs (``policy``: static, schedule, critical,
            error_budget, bandwidth; each with its own section), the dense warm-up, the
            error-feedback memory, the guard's thresholds and the LR ramp — see
            :class:`raycomp.config.CompressionSection`.
        controller: ``interval_steps`` (K: statistics, plan sync and agreement checks happen
            every K steps, never in between) and which controller service to talk to.
        checkpoint: ``every_steps`` also checkpoints (through ``ray.train.report``) every this
            many steps, so a crash mid-epoch replays fewer than that many steps;
            ``every_epochs`` is used by :func:`raycomp.train.report`'s default.
        output_dir: where per-rank step logs (``steps/rank<r>.jsonl``) and rank 0's
            ``evals.jsonl`` go (default: ``<tmp>/raycomp/<run_id>``).
        run_id: the run's key at the controller (default: the Ray Train run name, stable
            across worker restarts).
        seed: base seed of the compressors' random draws (same on every rank).
        progress_every: rank 0 logs one status line every this many steps (0: never).
        eval_kind: "accuracy" (higher is better) or "loss" (lower): how the controller reads
            the evaluation metric you report.
        strategy: "ddp" (DDP with raycomp's comm hook, compressed all-reduce) or "fsdp"
            (FSDP2: ``fully_shard`` on every child of an ``nn.ModuleList``/``nn.Sequential``
            that holds parameters, then the root, unless you sharded the model yourself;
            each unit's reduce-scatter compressed per destination shard; the adaptive
            policy then chooses int4, int8, bf16 or dense per unit). With "fsdp" build the
            optimizer over ``model.parameters()`` before :func:`raycomp.train.prepare_model`;
            raycomp points it at the sharded parameters.
        find_unused_parameters: DDP's option of that name (``strategy="ddp"`` only), for a
            model that skips parameters on some steps: a branch taken now and then, a head
            used by some batches. DDP then finds the unused parameters after each forward
            and all-reduces the map of used ones during backward (on DDP's group; the hook
            has a group of its own). It costs a traversal of the autograd graph a step, so
            leave it off for a model that uses every parameter on every step.
    """

    compression: CompressionSection = field(default_factory=CompressionSection)
    controller: ControllerSection = field(default_factory=ControllerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    output_dir: str | None = None
    run_id: str | None = None
    seed: int = 0
    progress_every: int = 0
    eval_kind: Literal["accuracy", "loss"] = "accuracy"
    strategy: Literal["ddp", "fsdp"] = "ddp"
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"strategy: must be 'ddp' or 'fsdp', got {self.strategy!r}")
        if not isinstance(self.find_unused_parameters, bool):
            raise ValueError(f"find_unused_parameters: must be True or False, got {self.find_unused_parameters!r}")
        if self.find_unused_parameters and self.strategy != "ddp":
            raise ValueError("find_unused_parameters: a DDP option; allowed with strategy='ddp' only, "
                             f"got strategy={self.strategy!r}")
        self.compression.check_strategy(self.strategy)


def resolve_options(options: TrainOptions, optimizer: torch.optim.Optimizer) -> TrainOptions:
    """``options`` as the run uses and registers them, resolved once: the adaptive policy is
    told what raycomp knows of the run, whether it is sharded (``strategy="fsdp"``: int4,
    int8, bf16 or dense per unit, priced as a reduce-scatter) and whether the optimizer
    suits lossy rungs (``lossy="auto"``, :func:`raycomp.train.lossy.lossy_setting`)."""
    compression = options.compression
    update: dict[str, Any] = {"lossy": lossy_setting(compression.adaptive, optimizer)}
    if options.strategy == "fsdp":
        update["sharded"] = True
    adaptive = compression.adaptive.model_copy(update=update)
    return dataclasses.replace(options, compression=compression.model_copy(update={"adaptive": adaptive}))
