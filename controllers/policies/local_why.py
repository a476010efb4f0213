"""The local-step choice's whys: fixed local steps (:class:`LocalFixedWhy`) and ``auto``'s
choice between per-step plans and local steps (:class:`LocalWhy`), each with the prose that
becomes the plan's reason."""

from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["LocalFixedWhy", "LocalWhy"]
