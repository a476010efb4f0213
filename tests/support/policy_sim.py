"""The adaptive policy's closed loop, simulated at the controller's interface: a 2-rank
run whose every control interval runs the plan the controller published, over a
:class:`Link` with a given bandwidth and per-round overhead, and reports what real workers
report (running byte totals, mean step/comm/compute seconds, per-layer gradient norms,
compression errors and bytes). :class:`Sim` drives the adaptive policy; :class:`LocalSim`
the same with ``compression.local`` (local steps). The tests of both policies, their
state and the recorded replays (tests/support/policy_replay.py) run on it."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from raycomp._internal.local import resolve_delay
from raycomp.config import LOCAL_MIN_GAIN, LocalSection
from raycomp.config.policy_options import AdaptiveOptions
from raycomp.controllers.service import Controller
from raycomp.plan import Plan

#: the digits MLP (hidden 512) plus a large 1-D parameter that PowerSGD cannot take
SHAPES = {"fc1.weight": [512, 64], "fc1.bias": [512], "fc2.weight": [512, 512], "fc2.bias": [512],
          "out.weight": [10, 512], "out.bias": [10], "norm.weight": [4096]}
K, WARMUP, WINDOW = 5, 20, 20
W = 2
#: the ladder the adaptive policy's mechanism tests were worked out on (their byte counts and predicted
#: steps); the default ladder, int4 first, has its own tests
TWO_RUNGS = ["int8", "bf16"]
#: ... and their critical layers' rung: the first near-lossless one, which a boost of 4
#: reaches from rank 1 past the four ranks. The default boost (2: rank 1 -> rank 4,
#: Accordion's pair) has its own test
TO_NEAR_LOSSLESS = 4
#: ... and no margin for the lossy rungs: the mechanism tests compare plans on time alone. The
#: default margin has its own test
ON_TIME_ALONE = 0.0
#: ... and a dense warm-up: their boundaries count from the first decision. The default
#: warm-up (near-lossless once the link is timed) has its own tests
DENSE_WARMUP = "dense"


@dataclass
class Link:
    bandwidth: float  # bytes/s per rank
    #: seconds per extra collective round (latency + codec): one figure, or per collective
    #: family ("powersgd", "topk", "quantized": int8/int4, "bf16")
    overhead: float | dict[str, float] = 0.002
    compute: float = 0.05  # seconds per step
    noise: float = 0.0  # relative jitter of compute and comm, uniform +-
    #: seconds a compressed step's codec takes on the rank's own thread: counted as compute
    #: by the rank (it is not waiting for the link), on every step that compresses a layer
    codec: float = 0.0


#: the links of most tests: dense communication against 0.05 s of compute per step
SLOW = Link(bandwidth=1.2e6)  # dense comm 1.0 s per step against 0.05 s of compute: ~20x
MEDIUM = Link(bandwidth=4e6)  # dense comm ~6x compute
FAST = Link(bandwidth=1e9)  # dense comm 1.2 ms: 0.02x compute


def numel(shape: list[int]) -> int:
    return math.prod(shape)


def layer_bytes(name: str, spec_name: str, params: dict) -> float:
    """What raycomp's ledger counts for one rank and step (raycomp._internal.transports)."""
    shape, n = SHAPES[name], numel(SHAPES[name])
    if spec_name == "powersgd":
        rows, cols = shape[0], n // shape[0]
        return 2 * (W - 1) / W * 4 * (rows + cols) * min(params["rank"], rows, cols)
    if spec_name == "topk":
        return (W - 1) * 8 * math.ceil(params["ratio"] * n)
    if spec_name == "int8":  # raycomp._internal.transports ScalableAllreduce: all-to-all, then all-gather
        return 2 * (W - 1) / W * (n + 8 * math.ceil(n / 2048))  # W = 2: one all-gather, the same bytes
    if spec_name == "int4":  # two codes a byte, the same (min, max) per chunk
        return 2 * (W - 1) / W * (math.ceil(n / 2) + 8 * math.ceil(n / 2048))
    if spec_name == "int2":  # tests/support/cheap_codec.py: four codes a byte
        return 2 * (W - 1) / W * (math.ceil(n / 4) + 8 * math.ceil(n / 2048))
    if spec_name == "bf16":
        return 2 * (W - 1) / W * 2 * n
    return 2 * (W - 1) / W * 4 * n


class Sim:
    def __init__(self, errors: dict[str, float] | None = None, **options) -> None:
        self.options = AdaptiveOptions(**{"window_steps": WINDOW, "near_lossless": TWO_RUNGS,
                                                "critical_boost": TO_NEAR_LOSSLESS, "lossy_margin": ON_TIME_ALONE,
                                                "warmup": DENSE_WARMUP, **options}).model_dump(mode="json")
        self.controller = Controller()
        self.controller.register_run("run", W, SHAPES, "adaptive", self.options, WARMUP, K, 1024)
        self.step = -1
        self.wire = self.dense = 0.0
        self.errors = errors or {}  # "powersgd r=1" -> relative error the workers measure
        self.rng = random.Random(0)
        self.plans: list[Plan] = []  # the plan in force at each boundary
        # a sharded (FSDP) run: a reduce-scatter sends each element (W-1)/W times, half an
        # all-reduce's 2(W-1)/W, in one all-to-all per unit whatever it carries
        self.sharded = bool(options.get("sharded"))

    @property
    def plan(self) -> Plan:
        return self.controller.runs["run"].plan

    def run(self, intervals: int, link: Link, norm: Callable[[int, str], float] = lambda s, n: 1.0,
            steps: int = K, stats: bool = True) -> Plan:
        """``intervals`` boundaries ``steps`` apart; ``stats=False``: reports without layer
        statistics (the workers measure them every K steps, so an early boundary has none)."""
        for _ in range(intervals):
            plan = self.plan  # workers run the latest published plan for the whole interval
            self.step += steps
            layers, wire, kinds = [], 0.0, set()
            for name, shape in SHAPES.items():
                spec = plan.spec_for(name)
                kind = spec.name if numel(shape) >= 1024 and not spec.is_dense else "none"
                kinds.add(kind)
                b = layer_bytes(name, kind, dict(spec.params)) * (0.5 if self.sharded else 1)
                wire += b
                label = f"powersgd r={dict(spec.params)['rank']}" if kind == "powersgd" else kind
                layers.append({"layer": name, "compressor": kind, "numel": numel(shape),
                               "grad_norm": norm(self.step, name),
                               "compression_error": self.errors.get(label, 0.5) if kind != "none" else 0.0,
                               "residual_norm": 0.0, "wire_bytes": b * W,
                               "dense_bytes": layer_bytes(name, "none", {}) * (0.5 if self.sharded else 1)})
            dense = sum(layer_bytes(n, "none", {}) for n in SHAPES) * (0.5 if self.sharded else 1)
            rounds = {} if self.sharded else {
                "powersgd": 2 * ("powersgd" in kinds), "topk": int("topk" in kinds),
                "quantized": (1 if W == 2 else 2) * bool({"int8", "int4", "int2"} & kinds), "bf16": int("bf16" in kinds)}
            per_round = link.overhead if isinstance(link.overhead, dict) else dict.fromkeys(rounds, link.overhead)
            jitter = lambda: 1 + self.rng.uniform(-link.noise, link.noise)  # noqa: E731
            comm = (wire / link.bandwidth + sum(r * per_round[f] for f, r in rounds.items())) * jitter()
            compute = (link.compute + link.codec * bool(kinds - {"none"})) * jitter()
            self.wire += wire * steps
            self.dense += dense * steps
            for rank in range(W):
                assert self.controller.ingest({
                    "run_id": "run", "rank": rank, "step": self.step, "epoch": 0, "plan_version": plan.version,
                    "loss": 1.0, "step_seconds": compute + comm, "compute_seconds": compute,
                    "comm_seconds": comm, "samples_per_second": 1000.0, "wire_bytes": self.wire,
                    "dense_bytes": self.dense, "layers": layers if stats else []})
            self.plans.append(self.plan)
        return self.plan

    def details(self) -> dict:
        return self.controller.policies["run"].details()


class LocalSim(Sim):
    """The adaptive policy's simulation, registered with ``compression.local``; ``fallback``
    is what the workers' reports say of the guard. ``min_gain`` is registered resolved, as a
    worker does (:func:`raycomp._internal.train.lossy.local_min_gain`): an SGD run's unless given.

    Under local steps the workers report inner steps and syncs: ``link.compute`` a step, and
    per step 1/H of a sync, which costs ``sync_factor`` x what its bytes and round take on
    the link (its codec, the outer step), less what the ``delay``'s inner steps hide (the
    tests register ``delay: 0``, a sync waited for at once, unless they ask for another); an
    interval that starts by leaving local steps or changing H also holds the sync of every
    fragment that the switch runs. ``overlap``: the compute that per-step intervals report,
    as a multiple of the real one (backward shares the cores with the reduction).
    ``slowdown``: the seconds a sync kept on the wire adds to the inner step it overlaps
    (its codec on the same cores), which the workers time as compute."""

    def __init__(self, local: dict, sync_factor: float = 1.0, overlap: float = 1.0, slowdown: float = 0.0,
                 **options) -> None:
        super().__init__(**options)
        self.controller = Controller()
        local = {"min_gain": LOCAL_MIN_GAIN["linear"], "delay": 0, **local}
        self.delay = local["delay"]
        self.controller.register_run("run", W, SHAPES, "adaptive",
                                     {**self.options, "local": LocalSection(**local).model_dump(mode="json")},
                                     WARMUP, K, 1024)
        self.fallback = False
        self.events: list[dict] = []
        self.loss = 1.0  # the training loss the workers report
        self.lr: float | None = None  # the learning rate they report (None: not reported)
        self.sync_factor, self.overlap, self.slowdown = sync_factor, overlap, slowdown
        self.link: Link | None = None
        self.previous_mode = None  # the local steps of the previous interval (None: per step)
        ingest = self.controller.ingest

        def with_workers_view(report: dict) -> bool:
            mode = self.plan.local_steps
            taken = ingest({**report, **self._timing(report, mode), "fallback_active": self.fallback,
                            "events": self.events if report["rank"] == 0 else [], "loss": self.loss,
                            "lr": self.lr})
            if report["rank"] == W - 1:
                self.previous_mode = mode
            return taken

        self.controller.ingest = with_workers_view

    def run(self, intervals: int, link: Link, *args, **kwargs) -> Plan:
        self.link = link
        return super().run(intervals, link, *args, **kwargs)

    def _timing(self, report: dict, mode) -> dict:
        sync = int4_sync(self.link) * self.sync_factor
        switch = sync / K if self.previous_mode is not None and mode != self.previous_mode else 0.0
        if mode is None:  # per step: the compute looks larger by the overlap, comm as measured
            compute = report["compute_seconds"] * self.overlap
            comm = report["comm_seconds"] + switch
        else:
            delay = resolve_delay(self.delay, mode.sync_every, mode.fragments)
            compute = self.link.compute + (self.slowdown / mode.sync_every if delay else 0.0)
            comm = max(0.0, sync - delay * self.link.compute) / mode.sync_every + switch
        return {"compute_seconds": compute, "comm_seconds": comm, "step_seconds": compute + comm}

    def local_details(self) -> dict:
        return self.details()["local"]


def int4_sync(link: Link) -> float:
    """A sync's seconds on ``link`` by its bytes: int4 pseudo-gradients of every compressible
    layer, and int4's one extra collective round at two ranks."""
    return sum(layer_bytes(n, "int4", {}) for n, s in SHAPES.items() if numel(s) >= 1024) / link.bandwidth \
        + link.overhead
