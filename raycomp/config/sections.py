"""The sections a worker reads: compression (with the guard and the LR ramp), the
controller link and checkpointing. A job config (``jobs.config.JobConfig``) nests them."""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from raycomp.config import policy_sections
from raycomp.config.base import _Strict

__all__ = ["LOCAL_MIN_GAIN", "CheckpointSection", "CompressionSection", "ControllerSection", "GuardSection",
           "LocalSection", "LrScalingSection", "host_literal"]


class GuardSection(_Strict):
    """Fallback to dense all-reduce, acted on by every rank in the same step."""

    config_key = "compression.guard"

    #: whether the guard falls back to dense (off: never; a step with a non-finite gradient
    #: or loss is still skipped)
    enabled: bool = True
    #: a loss spike: the mean loss of the last ``spike_steps`` steps above this factor x the
    #: level (``spike_quantile``) of the ``loss_window`` losses before them
    loss_spike_factor: Annotated[float, Field(gt=1)] = 3.0
    #: the steps of losses (and of gradient norms) a spike is compared against
    loss_window: Annotated[int, Field(ge=3, le=10_000)] = 20
    #: fall back when a layer's compression error exceeds this: on the DDP path the error of
    #: the mean every rank applied against the exact mean, on each statistics step, judged
    #: at the next agreement, for compressors that run with error feedback (an unbiased one
    #: is noisy by design); with FSDP each rank's own. Healthy runs measured up to 1.3
    #: (int4 at four ranks; Top-K and PowerSGD sit just under 1): 2 leaves room for them
    max_compression_error: Annotated[float, Field(gt=0)] = 2.0
    #: clean steps in dense fallback before compressing again (hysteresis)
    stable_steps: Annotated[int, Field(ge=1)] = 50
    #: a gradient explosion: the reduced gradient's norm above this factor x the level
    #: (``spike_quantile``) of the last ``loss_window`` norms; the step is skipped too
    grad_norm_factor: Annotated[float, Field(gt=1)] = 10.0
    #: the level of a window that a spike is compared to: this quantile of it (0.9: the 90th
    #: percentile, not the median: late per-batch losses are small and heavy-tailed)
    spike_quantile: Annotated[float, Field(ge=0.5, le=1)] = 0.9
    #: the loss is averaged over this many steps before it is compared (one hard batch is
    #: not a divergence, a sustained rise is)
    spike_steps: Annotated[int, Field(ge=1, le=1000)] = 5


class LrScalingSection(_Strict):
    """Compression-aware learning rate: ramp LR after a dense -> compressed switch."""

    config_key = "compression.lr_scaling"

    #: whether the LR ramps after each switch from dense to compressed
    enabled: bool = False
    #: steps the ramp takes, from ``start_factor`` x the learning rate back to 1 x
    warmup_steps: Annotated[int, Field(ge=1)] = 50
    #: the learning rate's factor at the first compressed step after a switch
    start_factor: Annotated[float, Field(gt=0, le=1)] = 0.5


#: ``compression.local.min_gain: auto``, by the optimizer's kind: linear in the gradient
#: (SGD) or not (the Adam family); see :func:`raycomp._internal.train.lossy.local_min_gain`
LOCAL_MIN_GAIN = {"linear": 0.1, "other": 1.0}


#: the compressor of the SparseLoCo recipe (its error feedback replaces the outer momentum)
SPARSELOCO = "sparseloco"


class LocalSection(_Strict):
    """``compression.local``: local steps, the DiLoCo family (off unless asked for).

    Each rank runs your optimizer (the inner one) for ``sync_every`` steps on its own
    batches without exchanging gradients; then the ranks average their pseudo-gradients
    (the last synchronised weights minus their own), compressed with error feedback as the
    plan says, and an outer optimizer steps the synchronised weights, from which every rank
    continues. Local steps change the optimization you wrote (fewer, larger averaged
    updates), so they are opt-in:

    * ``mode: off`` (default): every step's gradients are reduced, compressed as the
      policy says.
    * ``mode: fixed``: after the warm-up, local steps every ``sync_every`` steps, the
      pseudo-gradients compressed with ``compressor``.
    * ``mode: auto``: the controller chooses per-step compression or local steps, and
      their ``sync_every`` (a power of two up to ``max_sync_every``), from the measured
      link and compute: local steps when the best per-step plan's step is predicted more
      than ``min_gain`` slower than a local step (and while it is slower at all, once they
      run), with the smallest ``sync_every`` whose share of a sync per step is at most
      ``target_overhead`` of the compute, but no larger than the learning rate's decay
      allows (``sync_every_at_peak_lr``). Once local
      steps run, what an inner step and a sync really take is measured and ``sync_every``
      chosen again from it. A guard fallback during local steps halves the largest
      ``sync_every`` it may choose, and so does a loss that falls behind: above
      ``loss_tolerance`` over the lowest it reached since local steps began, at two
      boundaries in a row; after 10 boundaries without either, it doubles again.

    Outer optimizer: SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``. The default
    (lr 1.0, no momentum) is plain model averaging, as torch's ``PeriodicModelAverager``:
    on short runs with few ranks it lost less than DiLoCo's settings (lr 0.7, momentum
    0.9, Nesterov: tuned for ``sync_every`` = 500, 8 replicas and long runs), which you
    get with ``outer_lr: 0.7, outer_momentum: 0.9, nesterov: true``. The building block
    :class:`raycomp._internal.local.LocalSteps`, used on its own, defaults to the other choice:
    DiLoCo's Nesterov outer step and ``delay=0``, the published algorithm as written;
    this section's defaults are what raycomp's runs (short, few ranks, ``auto`` choosing
    H at run time) lost least with, and ``delay: auto`` overlaps a sync with one inner step.
    """

    config_key = "compression.local"

    #: off (every step's gradients reduced), fixed (local steps after the warm-up) or auto
    #: (the controller chooses per-step compression or local steps): see above
    mode: Literal["off", "fixed", "auto"] = "off"

    @field_validator("mode", mode="before")
    @classmethod
    def _off_as_yaml_reads_it(cls, value: Any) -> Any:
        """YAML 1.1 (PyYAML, in config files and ``key=value`` overrides) reads an unquoted
        ``off`` as False: take it as the word meant."""
        return "off" if value is False else value

    #: H, inner steps between two syncs of the model (``mode: fixed``); with ``auto`` the
    #: controller chooses it
    sync_every: Annotated[int, Field(ge=1, le=100_000)] = 8
    #: the largest H ``mode: auto`` may choose
    max_sync_every: Annotated[int, Field(ge=2, le=100_000)] = 32
    #: pieces of the model synced in turn, ``sync_every / fragments`` steps apart (Streaming
    #: DiLoCo): the wire is busy a little at a time instead of all at once
    fragments: Annotated[int, Field(ge=1, le=1024)] = 1
    #: inner steps a sync stays on the wire while training goes on (0: the sync is waited
    #: for at once); at most ``sync_every / fragments - 1``. "auto" (default): one step
    #: wherever the syncs are two or more steps apart (:func:`raycomp._internal.local.resolve_delay`).
    #: The ranks go on from the new synchronised weights plus what their inner steps moved
    #: meanwhile (Streaming DiLoCo's overlap); ``mode: auto`` counts the hidden part when it
    #: predicts a sync's cost
    delay: int | Literal["auto"] = "auto"
    #: the pseudo-gradients' compressor, in both modes (``auto`` also prices a sync with it
    #: when it chooses between per-step plans and local steps): int4 is Streaming DiLoCo's
    #: choice, int8 INTELLECT-1's, ``none`` sends them dense
    compressor: str = "int4"
    #: the outer SGD's learning rate (1.0 with no momentum: plain model averaging)
    outer_lr: Annotated[float, Field(gt=0, le=10)] = 1.0
    #: the outer SGD's momentum (DiLoCo: 0.9)
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    #: Nesterov momentum for the outer SGD (DiLoCo: true); needs ``outer_momentum`` > 0
    nesterov: bool = False
    #: floating-point buffers (BatchNorm statistics): "average" them densely at each sync of
    #: the first fragment, or keep them "local" to each rank
    buffers: Literal["average", "local"] = "average"
    #: ``auto``: choose local steps only if they are predicted at least this fraction faster
    #: than the best per-step plan (once chosen, they stay while they are faster at all).
    #: "auto" (default): 0.1 when the optimizer's update is linear in the gradient (SGD), 1.0
    #: for the others (the Adam family: local steps must be predicted twice as fast). A
    #: local step moves the loss less than a synchronous one, and much more so under Adam,
    #: where each rank's Adam normalises a gradient of its own, smaller batch: a smaller H
    #: does not help, and a step only a little faster loses time to target
    #: (:mod:`raycomp._internal.train.lossy`)
    min_gain: Annotated[float, Field(ge=0, le=10)] | Literal["auto"] = "auto"
    #: ``auto``: the share of the compute a sync may add per step
    target_overhead: Annotated[float, Field(gt=0, le=10)] = 0.1
    #: ``auto``: the largest H while the learning rate is at its peak; as the rate decays
    #: the largest H grows with the square of the decay, ``sync_every_at_peak_lr x (peak lr
    #: / lr)^2`` (the quadratic synchronization rule, Gu et al. 2024): the drift of local
    #: steps costs a run most at a high rate and little once it has decayed, so a large H
    #: waits for the decay. It is the H for two replicas; R replicas drift apart faster, as
    #: 1 - 1/R, and get ``x (1/2) / (1 - 1/R)`` of it (2/3 at 4). Set it to
    #: ``max_sync_every`` to choose H by time alone; under a constant rate it is the largest H
    sync_every_at_peak_lr: Annotated[int, Field(ge=2, le=100_000)] = 4
    #: ``auto``: how far (a fraction) the training loss, averaged over two boundaries, may
    #: rise above the lowest it reached since local steps began before H is halved. Training
    #: that works does not lose ground; an H too large for the run does, slowly, below the
    #: guard's spike factor. The training loss bumps with the data order under any mode,
    #: so the default sits above the bumps of the benchmarks' dense runs and of fixed-H
    #: runs that end no worse than dense. Raise it for a noisier loss (small batches)
    loss_tolerance: Annotated[float, Field(gt=0, le=10)] = 0.15

    @field_validator("delay", mode="before")
    @classmethod
    def _delay(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f"must be 'auto' or an integer >= 0, got {value!r}")

    @field_validator("compressor")
    @classmethod
    def _compressor(cls, name: str) -> str:
        from raycomp.compressors import REGISTRY

        REGISTRY.get(name)  # ValueError naming the allowed compressors
        return name

    @model_validator(mode="after")
    def _schedule(self) -> LocalSection:
        if self.sync_every % self.fragments:
            raise ValueError(f"fragments: must divide sync_every ({self.sync_every}), got {self.fragments}")
        if self.delay != "auto" and self.delay >= self.sync_every // self.fragments:
            raise ValueError(f"delay: must be below sync_every / fragments "
                             f"({self.sync_every // self.fragments}), got {self.delay}")
        if self.outer_momentum == 0 and self.nesterov:
            raise ValueError("nesterov: needs outer_momentum > 0")
        if self.compressor == SPARSELOCO and self.outer_momentum > 0:
            # the recipe's error feedback is its momentum: both together count the past twice
            raise ValueError(f"outer_momentum: must be 0 with compressor {SPARSELOCO!r} (SparseLoCo's error "
                             f"feedback replaces the outer momentum), got {self.outer_momentum}")
        return self


class CompressionSection(_Strict):
    """``compression``: the policy and its options, the warm-up, the error-feedback
    memory, the guard and the LR ramp.

    Besides its fields it holds one section per built-in policy, named after it
    (``compression.adaptive``, ``compression.static``, ...: the policy's typed options,
    :mod:`raycomp.config.policy_options`; see :mod:`raycomp.config.policy_sections`).
    """

    config_key = "compression"

    model_config = policy_sections.SECTION_CONFIG
    #: a built-in policy (``adaptive``, the default), a name registered with
    #: ``raycomp.controllers.policies.register_policy``, or an import path ``package.module:Class``
    #: that the controller imports (docs/extending.md)
    policy: str = "adaptive"
    #: options of a policy that is not built in, validated by its options model (built-in
    #: policies take theirs from their own section, e.g. ``compression.adaptive``)
    custom_options: dict[str, Any] = {}
    #: steps before the policy's own choice: dense, or under the adaptive policy near-lossless
    #: once its first (early) control boundary has timed the link (``compression.adaptive.warmup``)
    warmup_steps: Annotated[int, Field(ge=0)] = 20
    #: the error-feedback memory. "residual": what compression dropped is added to the next
    #: step's gradient; "dgc": DGC's momentum correction (run the optimizer without
    #: momentum); "none": dropped is lost
    memory: Literal["residual", "dgc", "none"] = "residual"
    #: layers with fewer elements always go dense (latency dominates their cost)
    min_compress_numel: Annotated[int, Field(ge=0)] = 1024
    #: "auto" (default): where Ray Train places several workers on each of several nodes,
    #: compressed steps reduce in two levels, dense inside each node and compressed across
    #: nodes, one piece per worker of the node (raycomp._internal.reduce.two_level); one node, or one worker
    #: per node, is the flat path. "flat": every worker is its own node. A checkpoint
    #: restored at another size or layout merges every worker's pieces
    #: (raycomp._internal.train.resize). Under local steps a replica is then a node: inner steps
    #: data-parallel inside it, syncs across nodes in pieces
    levels: Literal["flat", "auto"] = "auto"
    #: the dense fallback: see :class:`GuardSection`
    guard: GuardSection = GuardSection()
    #: the LR ramp after a dense -> compressed switch: see :class:`LrScalingSection`
    lr_scaling: LrScalingSection = LrScalingSection()
    #: local steps (``mode: off`` by default): see :class:`LocalSection`
    local: LocalSection = LocalSection()
    #: DDP ``bucket_cap_mb`` (MB of gradients per bucket) of the run's DDP model. The hook
    #: sends each bucket while backward computes the next (decoding it once its collectives
    #: complete), so smaller buckets hide more of the wire behind backward; each costs a round.
    #: "auto": about 8 buckets, between DDP's 1 MB first bucket and its 25 MB default
    #: (raycomp.bucket_cap_mb; a model of 200 MB+ keeps DDP's 25 MB). FSDP
    #: (scaling.strategy=fsdp) has no DDP buckets and ignores it
    bucket_cap_mb: float | Literal["auto"] = "auto"

    @field_validator("bucket_cap_mb", mode="before")
    @classmethod
    def _bucket_cap(cls, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not 0 < number <= 100_000:
            raise ValueError(f"must be 'auto' or a size in MB in (0, 100000], got {value!r}")
        return number

    @model_validator(mode="before")
    @classmethod
    def _policy_sections(cls, data: Any) -> Any:
        return policy_sections.split_sections(data, set(cls.model_fields)) if isinstance(data, dict) else data

    _policy_name = field_validator("policy")(lambda cls, name: policy_sections.check_policy_name(name))

    @model_validator(mode="after")
    def _custom_options(self) -> CompressionSection:
        policy_sections.check_custom_options(self.policy, self.custom_options)
        return self

    @model_validator(mode="after")
    def _sparseloco_memory(self) -> CompressionSection:
        if self.local.mode != "off" and self.local.compressor == SPARSELOCO and self.memory == "none":
            raise ValueError(f"memory: 'none' drops the error feedback of local.compressor {SPARSELOCO!r}, "
                             "which replaces its outer momentum; allowed: residual")
        return self

    def check_strategy(self, strategy: str) -> None:
        """ValueError (one line) unless this compression can run with ``strategy``: with
        ``fsdp`` every compressor it may choose must fit a reduce-scatter row."""
        if strategy != "fsdp":
            return
        if self.local.mode != "off":
            raise ValueError(f"compression.local.mode: {self.local.mode!r} is not available with "
                             "scaling.strategy=fsdp (local steps keep a full copy of the weights); allowed: off")
        policy_sections.check_sharded_policy(self)
        if self.memory == "dgc":
            raise ValueError("compression.memory: 'dgc' is not available with scaling.strategy=fsdp; "
                             "allowed: residual, none")
        policy_sections.check_sharded_options(self)

    def policy_options(self) -> dict[str, Any]:
        """The options the controller gets for ``policy`` (JSON), with ``local`` unless its
        mode is off."""
        options = policy_sections.options_of(self)
        if self.local.mode != "off":
            options = {**options, "local": self.local.model_dump(mode="json")}
        return options


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host_literal(value: str) -> str:
    """``value`` if it is an IPv4/IPv6 address or a syntactically valid host name (RFC 1123).

    Pure syntax (no network): whether a name resolves is checked before a job starts.
    A dotted string of numbers must be a valid IPv4 address, so ``0.0.0.0.0`` and
    ``256.1.1.1`` are refused here rather than looked up as names.
    """
    allowed = "an IPv4 or IPv6 address (e.g. 127.0.0.1, ::1) or a host name (e.g. localhost)"
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if not value or len(value) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"must be {allowed}, got {value!r}")
    if labels[-1].isdigit():  # all-numeric top label: meant as an IPv4 address
        raise ValueError(f"{value!r} is not a valid IPv4 address; must be {allowed}")
    return value


class ControllerSection(_Strict):
    """``controller``: how often the ranks meet the controller, and which controller service
    (a Ray actor) they talk to, with its snapshots, restarts and metrics endpoint."""

    config_key = "controller"

    #: K, steps between two control boundaries: statistics go to the controller, a new plan
    #: comes back and the ranks check they agree, every K steps and never in between
    interval_steps: Annotated[int, Field(ge=1, le=100_000)] = 10
    #: one boundary more, after the run's first this many steps (when fewer than K): a
    #: policy whose warm-up chooses from the link's measured speed (the adaptive default)
    #: then has it after 3 dense steps, not K. On a 100 Mbit/s link a dense step of a
    #: 10 MB model takes about a second; the statistics of so short an interval hold no
    #: layer statistics yet (those come every K steps)
    first_interval_steps: Annotated[int, Field(ge=1, le=100_000)] = 3
    #: how the guard's values and rank 0's new plan reach every rank on a dense step that
    #: DDP's own reduction carries, where no collective of raycomp's runs. ``at_boundaries``:
    #: none while the guard is not in fallback, so such a step costs what plain DDP's does
    #: (no collective round of raycomp's); the ranks agree two steps after each boundary
    #: (the controller's answer to its statistics is in force from the step after, unless
    #: it took longer: then from the next agreement), and that agreement's all-gather
    #: carries the losses of those steps to the guard. ``every_step``: a tiny all-reduce of
    #: their own each such step (a plan is in force two steps after it arrives, whenever
    #: that is; every loss is judged on its step), about 1 ms of CPU a step. A non-finite
    #: gradient is caught on its step either way (the mean's norm), and compressed steps
    #: carry the values in their own collectives
    dense_control: Literal["every_step", "at_boundaries"] = "at_boundaries"
    #: the controller actor's name (runs that name the same one share it)
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp-controller"
    #: the Ray namespace of the controller actor
    namespace: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "raycomp"
    #: where the controller keeps its state across restarts (None: ``jobs.train`` uses
    #: ``<storage_path>/_controller``; ``raycomp.train.ControllerCallback`` keeps it in memory)
    snapshot_dir: str | None = None
    #: Ray's ``max_restarts`` of the controller actor (-1: restart it without limit)
    max_restarts: Annotated[int, Field(ge=-1)] = -1
    #: whether the controller serves Prometheus metrics
    metrics_enabled: bool = True
    #: the metrics endpoint's address (loopback unless you mean to expose it)
    metrics_host: str = "127.0.0.1"
    #: the metrics endpoint's port (0: pick a free port)
    metrics_port: Annotated[int, Field(ge=0, le=65_535)] = 9478
    #: Prometheus file-SD list (default: /tmp/raycomp/prometheus/<name>.json)
    metrics_sd_file: str | None = None
    #: seconds a finished run's state stays at the controller (its metrics still exported)
    #: before it is dropped
    finished_run_grace_s: Annotated[float, Field(ge=0)] = 300.0
    #: a worker that finds no service of this name fails at ``prepare_model`` with a one-line
    #: error; False: it trains dense, uncompressed, for the whole run (and warns so)
    required: bool = True

    _host = field_validator("metrics_host")(lambda cls, value: host_literal(value))


class CheckpointSection(_Strict):
    """When raycomp writes a checkpoint (model, optimizer, scheduler and every rank's
    compressor and error-feedback state, through ``ray.train.report``).

    By default once, at the end: ``raycomp.train.report(metrics)`` (``checkpoint=None``)
    checkpoints when it is called

    * in the last epoch of ``loop.epochs(epochs, steps_per_epoch)`` (raycomp knows which
      epoch is the last only from that call: without it, pass ``checkpoint=True``);
    * in an epoch ``e`` (0-based) with ``(e + 1) % every_epochs == 0``, when ``every_epochs``
      is set;
    * at an epoch's last step that is a multiple of ``every_steps``, when set (any other
      multiple is checkpointed inside ``raycomp.train.step``, so that a crash mid-epoch
      replays fewer than ``every_steps`` steps).

    ``report(metrics, checkpoint=True/False)`` overrides the rule for that call. A run that
    should survive a worker failure (``FailureConfig(max_failures=...)``) must set
    ``every_epochs`` or ``every_steps``: without a checkpoint a restarted run starts from
    step 0. Ray Train's ``CheckpointConfig(num_to_keep=...)`` bounds how many are kept.
    """

    config_key = "checkpoint"

    #: also checkpoint the report of every this many epochs (None: only the last epoch's)
    every_epochs: Annotated[int | None, Field(ge=1)] = None
    #: also checkpoint every this many steps, so a crash on a long epoch replays few steps
    every_steps: Annotated[int | None, Field(ge=1)] = None
    #: on a notice that a node hosting a worker is about to be preempted (Ray Train's, read
    #: by every rank at each agreement and carried in its all-gather), every rank
    #: checkpoints there, once per notice, and training goes on: the restart replays only
    #: the steps after it. ``raycomp.train`` only; a framework checkpoints
    #: through its own callbacks (``docs/elastic.md``)
    on_preemption: bool = True
    #: worker-group restarts a job allows: read by ``python -m jobs.train`` only (its
    #: ``FailureConfig(max_failures=...)``). ``raycomp.train`` ignores it: with the Ray Train
    #: API, pass ``FailureConfig(max_failures=...)`` to your ``RunConfig``
    max_failures: Annotated[int, Field(ge=0, le=100)] = 2

    def at_report(self, epoch: int, step: int, epochs: int | None = None,
                  steps_per_epoch: int | None = None) -> bool:
        """Whether a report with ``checkpoint=None`` checkpoints (the rule above): called in
        0-based ``epoch`` of ``epochs`` (None: unknown) after ``step`` steps in all."""
        if epochs is not None and epoch + 1 >= epochs:
            return True
        if self.every_epochs is not None and (epoch + 1) % self.every_epochs == 0:
            return True
        epoch_end = bool(steps_per_epoch) and step % steps_per_epoch == 0  # type: ignore[operator]
        return self.every_steps is not None and epoch_end and step > 0 and step % self.every_steps == 0
