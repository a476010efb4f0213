"""The typed options of :func:`raycomp.train.prepare_model`, each with its default."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import ValidationError

from raycomp._internal.train.lossy import local_min_gain, lossy_setting
from raycomp.config import (
    CheckpointSection,
    CompressionSection,
    ConfigError,
    ControllerSection,
    one_line,
    policy_context,
)

__all__ = ["TrainOptions", "resolve_options"]


@dataclass(frozen=True)
class TrainOptions:
    """How raycomp steers one Ray Train run.

    A section may be given as its class or as a plain dict of its keys, at any depth
    (``compression={"policy": "static", "static": {"compressor": {"name": "topk",
    "ratio": 0.1}}}``); a bad value is a one-line ``ValueError`` naming its dotted key,
    e.g. ``compression.adaptive.threshold: ...``.

    Args:
        compression: the policy the controller runs (``policy``: ``adaptive``, the default,
            or ``static``, ``schedule``, ``critical``, ``error_budget``, ``bandwidth``; each
            with its own section, e.g. ``compression.adaptive``), the warm-up
            (``warmup_steps``, default 20), the error-feedback memory, the guard's
            thresholds and the LR ramp — see :class:`raycomp.config.CompressionSection`.
        controller: ``interval_steps`` (K, default 10: statistics, plan sync and agreement
            checks happen every K steps, never in between) and which controller service to
            talk to.
        checkpoint: when :func:`raycomp.train.report` checkpoints (default: only in the last
            epoch); ``every_epochs`` adds every this many epochs, ``every_steps`` every this
            many steps (a crash mid-epoch then replays fewer than that many) — see
            :class:`raycomp.config.CheckpointSection`.
        output_dir: where per-rank step logs (``steps/rank<r>.jsonl``) and rank 0's
            ``evals.jsonl``, ``plans.jsonl`` (the plan timeline) and ``summary.json`` go.
            Default: the Ray Train run's directory, ``<storage_path>/<name>`` of its
            ``RunConfig``, beside its checkpoints (on remote storage the files are written
            to ``<tmp>/raycomp/<run_id>`` and copied there at :func:`raycomp.train.finish`;
            :mod:`raycomp._internal.train.outputs`). ``raycomp inspect`` reads them.
        run_id: the run's key at the controller (default: the Ray Train run name, stable
            across worker restarts).
        seed: base seed of the compressors' random draws (same on every rank).
        progress_every: rank 0 logs one status line every this many steps (0: never): the
            step, loss, compression ratio so far, the plan in force in a few words and
            samples/s. Default 100: with steps of 10 ms to 1 s that is a line every 1 to 100
            seconds, enough to see a run move without burying the driver's console (every
            step is in the step log anyway). Plan switches are logged as they happen,
            whatever this says.
        eval_metric: the key of :func:`raycomp.train.report`'s metrics that is an
            evaluation (default ``"accuracy"``): a report holding it also records an
            evaluation, as :func:`raycomp.train.record_eval` does (a line of rank 0's
            ``evals.jsonl``, the value to the controller). None: only ``record_eval`` records.
        eval_kind: "accuracy" (higher is better, the default) or "loss" (lower): what the
            evaluation metric is; the controller exports it under this label
            (``raycomp_eval_metric``). No built-in policy steers by the metric.
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
    progress_every: int = 100
    eval_metric: str | None = "accuracy"
    eval_kind: Literal["accuracy", "loss"] = "accuracy"
    strategy: Literal["ddp", "fsdp"] = "ddp"
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        for name, section in (("compression", CompressionSection), ("controller", ControllerSection),
                              ("checkpoint", CheckpointSection)):
            object.__setattr__(self, name, _section(name, section, getattr(self, name)))
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"strategy: must be 'ddp' or 'fsdp', got {self.strategy!r}")
        if self.eval_metric is not None and not (isinstance(self.eval_metric, str) and self.eval_metric):
            raise ValueError(f"eval_metric: must be a metric name (a non-empty string) or None, "
                             f"got {self.eval_metric!r}")
        if self.eval_kind not in ("accuracy", "loss"):
            raise ValueError(f"eval_kind: must be 'accuracy' or 'loss', got {self.eval_kind!r}")
        if isinstance(self.progress_every, bool) or not isinstance(self.progress_every, int) \
                or self.progress_every < 0:
            raise ValueError(f"progress_every: must be an integer >= 0 (0: never), got {self.progress_every!r}")
        if not isinstance(self.find_unused_parameters, bool):
            raise ValueError(f"find_unused_parameters: must be True or False, got {self.find_unused_parameters!r}")
        if self.find_unused_parameters and self.strategy != "ddp":
            raise ValueError("find_unused_parameters: a DDP option; allowed with strategy='ddp' only, "
                             f"got strategy={self.strategy!r}")
        self.compression.check_strategy(self.strategy)


def _section(name: str, section: type, value: Any) -> Any:
    """``value`` as a ``section``: itself, or built from a dict of its keys (a one-line
    error naming the dotted key of a bad value)."""
    if isinstance(value, section):
        return value
    if isinstance(value, Mapping):
        from raycomp.controllers.policies import REGISTRY  # the policies registered in this process

        try:
            return section.model_validate(dict(value), context=policy_context(REGISTRY))
        except ValidationError as error:
            raise ConfigError(one_line(error, prefix=f"{name}.")) from None
    raise ConfigError(f"{name}: must be a {section.__name__} or a dict of its keys, got {type(value).__name__}")


def resolve_options(options: TrainOptions, optimizer: torch.optim.Optimizer) -> TrainOptions:
    """``options`` as the run uses and registers them, resolved once: the adaptive policy is
    told what raycomp knows of the run, whether it is sharded (``strategy="fsdp"``: int4,
    int8, bf16 or dense per unit, priced as a reduce-scatter) and whether the optimizer
    suits lossy rungs (``lossy="auto"``, :func:`raycomp._internal.train.lossy.lossy_setting`); local
    steps' ``min_gain`` (``"auto"``: :func:`raycomp._internal.train.lossy.local_min_gain`)."""
    compression = options.compression
    update: dict[str, Any] = {"lossy": lossy_setting(compression.adaptive, optimizer)}
    if options.strategy == "fsdp":
        update["sharded"] = True
    adaptive = compression.adaptive.model_copy(update=update)
    local = compression.local.model_copy(update={"min_gain": local_min_gain(compression.local, optimizer)})
    return dataclasses.replace(options, compression=compression.model_copy(update={"adaptive": adaptive,
                                                                                  "local": local}))
