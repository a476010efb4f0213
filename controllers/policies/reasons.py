"""Every policy's *why*: the named facts behind a decision, and the one place their prose
(the plan's ``reason``) is written. A policy decides and fills a why; it writes no prose."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Said:
    """A decision one sentence explains in full (a fixed plan, a dense one until measured)."""

    rule: str
    words: str

    def text(self) -> str:
        return self.words


@dataclass(frozen=True)
class ScheduleWhy:
    start_step: int  # the stage in force from this step
    rule: str = "schedule.stage"

    def text(self) -> str:
        return f"schedule stage from step {self.start_step}"


@dataclass(frozen=True)
class CriticalWhy:
    critical: int  # layers in a critical regime (light compression)
    layers: int
    rule: str = "critical.regimes"

    def text(self) -> str:
        return f"critical: {self.critical}/{self.layers} layers critical"


@dataclass(frozen=True)
class BudgetWhy:
    solved: int  # layers with a measured error profile at the latest solve
    layers: int
    rule: str = "error_budget.solve"

    def text(self) -> str:
        return f"error_budget: {self.solved}/{self.layers} layers solved"


@dataclass(frozen=True)
class BandwidthWhy:
    ratio: float  # the Top-K ratio in force (1.0: dense)
    rule: str = "bandwidth.ratio"

    def text(self) -> str:
        return f"bandwidth: ratio {self.ratio:g}"


@dataclass(frozen=True)
class AdaptiveWhy:
    """The adaptive chooser's decision: the link and compute it measured, every candidate
    shift's predicted step (``predicted[top]``: all dense), the shift chosen and the rule
    that chose it."""

    rule: str  # adaptive.first | adaptive.floors | adaptive.band | adaptive.outside_band | adaptive.switch
    bandwidth: float  # bytes/s per rank
    compute: float  # seconds a step computes
    predicted: tuple[float, ...]  # seconds a step per shift, heaviest first, all-dense last
    shift: int
    top: int  # the all-dense shift
    groups: tuple[tuple[str, int], ...]  # (compressor label, layers on it), most layers first
    critical: int  # layers in a critical regime
    raised: int  # layers whose floor their error raised
    dense_layers: int  # compressible layers left dense
    lossy_off: bool  # lossy rungs not offered
    prior_band: float | None  # the fastest plan was priced on the assumed round overhead: its band
    passed_over_margin: float | None  # a lossy plan was faster, but not by this margin
    #: (nodes, ranks per node) of a two-level run (raycomp._internal.reduce.two_level); None: flat
    levels: tuple[int, int] | None = None
    #: bytes/s of an all-reduce inside a node, as the run timed it (two levels); None: untimed
    node_link: float | None = None
    #: the fastest compressed plan that may be chosen (a lossy one only if lossy_margin faster
    #: than any without), and the band around the fastest plan within which the lightest is
    #: taken: what a dense choice is weighed against. None: no compressed plan may be chosen
    #: (a dense choice then quotes the fastest of all)
    best_compressed: float | None = None
    slack: float | None = None

    def text(self) -> str:
        dense_s, best_s = self.predicted[self.top], self.predicted[self.shift]
        # the link in figures, never "fast" or "slow": what makes it either is how its dense
        # communication compares with the compute, so the ratio says it
        ratio = (dense_s - self.compute) / self.compute if self.compute > 0 else math.inf
        name = "link" if self.levels is None else "node link"
        link = f"{name} {self.bandwidth / 1e6:.3g} MB/s, communication {ratio:.2g}x compute"
        if self.levels is not None:  # what each level does: the node's link is the one measured
            nodes, per_node = self.levels
            inside = "" if self.node_link is None else f" at {self.node_link / 1e6:.3g} MB/s"
            link = f"{nodes} nodes x {per_node}, inside each node dense{inside}; across nodes: {link}"
        if not self.groups:
            lightest = self.best_compressed if self.best_compressed is not None else \
                min(self.predicted[:self.top]) if self.top else dense_s
            # the verdict the figures give: no compressed plan is faster, or none enough
            link += ": compressing cannot pay" if lightest >= dense_s else ": compressing saves too little"
            notes = []
            if lightest < dense_s and self.prior_band is not None:
                notes.append(f"within {self.prior_band:.0%} on the assumed round overhead")
            elif lightest < dense_s and self.slack is not None:
                notes.append(f"within {self.slack:.0%}")
            if self.passed_over_margin is not None:
                notes.append(f"lossy not {self.passed_over_margin:.0%} faster")
            tail = f" ({', '.join(notes)})" if notes else ""
            return f"{link} → dense: compressed {lightest * 1e3:.3g} ms vs dense {dense_s * 1e3:.3g} ms{tail}"
        parts = [f"{label} on {count}" for label, count in self.groups]
        extras = [f"{self.critical} critical"] if self.critical else []
        extras += [f"{self.raised} lighter for error"] if self.raised else []
        extras += [f"{self.dense_layers} dense"] if self.dense_layers else []
        extras += ["lossy rungs off"] if self.lossy_off else []
        extras += [f"lossy not {self.passed_over_margin:.0%} faster"] if self.passed_over_margin is not None else []
        tail = f" ({', '.join(extras)})" if extras else ""
        return f"{link} → {'; '.join(parts)}{tail}; {best_s * 1e3:.3g} ms vs dense {dense_s * 1e3:.3g} ms"


@dataclass(frozen=True)
class WarmupWhy:
    """A decision inside ``compression.warmup_steps``, by the warm-up's own choice."""

    inner: AdaptiveWhy | Said

    @property
    def rule(self) -> str:
        return f"warmup.{self.inner.rule}"

    def text(self) -> str:
        return f"warm-up: {self.inner.text()}"


@dataclass(frozen=True)
class LocalFixedWhy:
    sync_every: int
    pseudo: str  # the pseudo-gradients' compressor
    rule: str = "local.fixed"

    def text(self) -> str:
        return f"local steps: fixed, H={self.sync_every}, pseudo-gradients {self.pseudo}"


@dataclass(frozen=True)
class LocalWhy:
    """``compression.local.mode: auto``: per step against local steps, as priced.

    ``rule``: local.per_step, local.steps, local.probe (an H taken to be measured) or
    local.measuring (a probe held until its step is measured)."""

    rule: str
    h: int  # the H in force after the decision (0: per step)
    pseudo: str  # the pseudo-gradients' compressor
    per_step_reason: str  # the per-step plan's own reason (when per step)
    per_step: float  # predicted seconds a step, per step
    local_step: float  # predicted seconds a step under local steps at the candidate H
    compute: float  # seconds an inner step computes
    sync: float  # seconds a sync costs
    stall: float  # seconds of it not behind the next inner step (predicted syncs)
    candidate: int  # the H local steps were priced at (0: none allowed)
    by_time: int  # the H the link alone asks for
    lr_fraction: float | None  # the learning rate over its peak, when it capped H
    min_gain: float  # the margin to enter local steps
    staying: bool  # local steps were in force: staying needs only to be faster
    sync_scale: float | None  # a sync measured, as a multiple of the byte model
    slowdown: float | None  # seconds a sync on the wire adds to the inner steps it overlaps
    slowdown_from: tuple[int, ...]  # the two H the slowdown was measured from
    probe_taken: float | None  # seconds a step took at the H before the probe
    replicas: int = 2  # the replicas of local steps (the learning rate's cap is for two)
    #: of ``compute``: an inner step's all-reduce inside the node (node replicas), priced
    #: at the node's timed link until inner steps are measured
    inside: float = 0.0

    def text(self) -> str:
        if self.sync_scale is not None and self.slowdown is not None:
            a, b = self.slowdown_from
            measured = (f" as measured, {self.slowdown * 1e3:.0f} ms of it what it adds to the inner steps it "
                        f"overlaps (from H={a} and {b})")
        elif self.sync_scale is not None:
            measured = f" as measured: inner steps, and syncs at {self.sync_scale:.2g}x the byte model"
        elif self.candidate:
            measured = f", {self.stall * 1e3:.0f} ms of it not behind the next inner step"
        else:
            measured = ""
        capped = "" if self.lr_fraction is None else \
            f"; H={self.by_time} by time, at most {self.candidate} at a learning rate {self.lr_fraction:.2g}x its peak" \
            + (f" and {self.replicas} replicas" if self.replicas > 2 else "")
        rule = "faster to stay" if self.staying else f"{self.min_gain:.0%} faster"
        inside = f" with {self.inside * 1e3:.0f} ms inside the node" if self.inside else ""
        figures = (f"per step {self.per_step * 1e3:.0f} ms predicted, local steps {self.local_step * 1e3:.0f} ms "
                   f"(compute {self.compute * 1e3:.0f} ms{inside}, a sync {self.sync * 1e3:.0f} ms{measured}; local steps "
                   f"must be {rule}{capped})")
        if not self.h:
            return f"per step: {self.per_step_reason}; {figures}"
        if self.rule == "local.probe":
            trying = (f"; trying H={self.h}: H={self.h // 2} took {(self.probe_taken or 0.0) * 1e3:.0f} ms a step, "
                      f"and a second H tells what a sync slows the inner step it overlaps from the compute")
        else:
            trying = f"; measuring H={self.h} before choosing again" if self.rule == "local.measuring" else ""
        return f"local steps: H={self.h}, pseudo-gradients {self.pseudo}; {figures}{trying}"


__all__ = ["AdaptiveWhy", "BandwidthWhy", "BudgetWhy", "CriticalWhy", "LocalFixedWhy", "LocalWhy", "Said",
           "ScheduleWhy", "WarmupWhy"]
