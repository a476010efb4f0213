"""The adaptive policy's whys: the chooser's decision (:class:`AdaptiveWhy`, the link and
compute it measured, every candidate's predicted step, what it chose) and the warm-up's
(:class:`WarmupWhy`), each with the prose that becomes the plan's reason."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decision import Said


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


__all__ = ["AdaptiveWhy", "WarmupWhy"]
