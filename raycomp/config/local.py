"""``compression.local``: local steps (the DiLoCo family), off unless asked for."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from raycomp.config.base import Strict

#: ``compression.local.min_gain: auto``, by the optimizer's kind: linear in the gradient
#: (SGD) or not (the Adam family); see :func:`raycomp._internal.train.lossy.local_min_gain`
LOCAL_MIN_GAIN = {"linear": 0.1, "other": 1.0}


#: the compressor of the SparseLoCo recipe (its error feedback replaces the outer momentum)
SPARSELOCO = "sparseloco"


class LocalSection(Strict):
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
    #: local step moves the loss less than a step of reduced gradients, and much more so under Adam,
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


__all__ = ["LOCAL_MIN_GAIN", "SPARSELOCO", "LocalSection"]
