"""The adaptive policy's chooser: regimes, error judging, the choice among the priced
candidate plans, and its hysteresis (the rules: ``docs/cost-model.md``)."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from controllers.policies.cost_model import CostModel, mean
from controllers.policies.ladders import Ladders, label
from controllers.state import LayerHistory, RunState
from raycomp.plan import CompressorSpec, Plan

if TYPE_CHECKING:
    from raycomp.config.policy_options import AdaptiveOptions

PATIENCE = 2  # consecutive boundaries outside the band before a link-driven switch
#: Until a compressed interval has measured the round overhead, compression must save this
#: many slacks against dense (among compressed plans the band stays one slack): what a
#: compressed round costs also holds its codec and the overlap it loses, which the prior
#: (round_seconds, latency) does not price
PRIOR_BAND = 2
HISTORY = 32
ERROR_SAMPLES = 2  # error samples of a rung (one per control interval) before it is judged


class Chooser:
    """Floors per layer, and the shift (a level on every ladder) of the plan in force."""

    def __init__(self, options: AdaptiveOptions, cost: CostModel, min_numel: int) -> None:
        self.cost, self.min_numel = cost, min_numel
        self.lossy = options.lossy != "never"  # "auto" unresolved: as "always"
        self.sharded = options.sharded
        self.ladders = Ladders(options.ranks, options.topk_ratios, options.near_lossless, self.lossy, self.sharded)
        self.rungs_near_lossless = len(options.near_lossless)
        self.threshold, self.window = float(options.threshold), int(options.window_steps)
        self.boost, self.max_error = int(options.critical_boost), float(options.max_error)
        self.slack, self.margin = float(options.slack), float(options.lossy_margin)
        # regimes and floors
        self.last_detect: int | None = None
        self.critical: dict[str, bool] = {}
        self.error_floor: dict[str, int] = {}
        self.rungs: dict[str, int] = {}  # layer -> rung in the latest plan
        #: layer -> step from which its error samples are judged: when its compressor family
        #: was decided, or its last error judgement (a PowerSGD rank change does not restart it)
        self.rung_since: dict[str, int] = {}
        self.floors: dict[str, int] = {}  # layer -> floor rung at the latest decision
        # the choice
        self.shift: int | None = None  # None: nothing decided yet
        self.dense_chosen = False
        self.prior_families: set[str] = set()  # families of the choice in force priced on the prior
        self.strikes = self.switches = 0
        self.predicted: list[float] = []
        self.history: deque[list[Any]] = deque(maxlen=HISTORY)  # [step, choice, reason]

    def decide(self, run: RunState) -> Plan:
        layers = {n: h for n, h in run.layers.items() if h.numel >= max(1, self.min_numel)}
        if not layers:
            return Plan(reason="adaptive: no layer large enough to compress")
        if not self.cost.ready:
            return Plan(reason="adaptive: dense until a dense interval has timed the link")
        if self.last_detect is None or run.step - self.last_detect >= self.window:
            self._detect(run, layers)
        self._judge_errors(run, layers)
        ladders = {name: self.ladders.ladder(h) for name, h in layers.items()}
        floors = {name: self._floor(name, ladders[name]) for name in layers}
        # the all-dense shift: one past the shift that puts every layer on its lightest
        # compressed rung (with near-lossless rungs: bf16 everywhere is a candidate of its own)
        levels = max(self.ladders.first_near_lossless(ladders[n]) for n in layers)  # the most lossy rungs
        top = levels + self.rungs_near_lossless
        candidates = [{n: self.ladders.rung(ladders[n], floors[n], s, levels, top) for n in layers}
                      for s in range(top + 1)]
        priced = [self.cost.predict(run, {n: ladders[n][r] for n, r in rungs.items()}) for rungs in candidates]
        self.predicted = [seconds for seconds, _ in priced]
        eligible = self._worth_the_risk(ladders, candidates)
        fastest = min(eligible, key=self.predicted.__getitem__)
        best = self.predicted[fastest]
        within = [s for s in eligible if self.predicted[s] <= (1 + self.slack) * best]
        best_on_prior = bool(self.cost.on_prior(priced[fastest][1]))
        if best_on_prior and self.predicted[top] <= (1 + PRIOR_BAND * self.slack) * best:
            within.append(top)  # on the assumed overhead compression must save more to be used
        target = max(within)
        current = None if self.shift is None else (top if self.dense_chosen else min(self.shift, top))
        if current is None or self.prior_families & self.cost.overhead.keys():
            # the first decision, or the first since a family the choice in force was priced
            # on the assumed round_seconds for has been measured: no hysteresis for a guess
            current, self.strikes = target, 0
        elif floors != self.floors:
            # a regime or error change moves the layers it concerns; layers that move lighter
            # must not make the others (floor unchanged) heavier. With no floor raised
            # (layers calmed down) the choice is made afresh
            raised = any(floors[n] > self.floors.get(n, floors[n]) for n in layers)
            kept = [n for n in layers if floors[n] == self.floors.get(n) and n in self.rungs] if raised else []
            lowest = next(s for s, rungs in enumerate(candidates) if all(rungs[n] >= self.rungs[n] for n in kept))
            current, self.strikes = max(target, lowest), 0
        elif current in within:
            self.strikes = 0
        else:
            self.strikes += 1
            if self.strikes >= PATIENCE:
                current, self.strikes = target, 0
                self.switches += 1
        self.shift, self.dense_chosen, self.floors = current, current == top, floors
        self.prior_families = self.cost.on_prior(priced[current][1])
        chosen: dict[str, CompressorSpec] = {}
        for name in layers:
            rung = candidates[current][name]
            old = self.rungs.get(name)
            if old is None or ladders[name][old].name != ladders[name][rung].name:
                self.rung_since[name] = run.step
            self.rungs[name] = rung
            if not ladders[name][rung].is_dense:
                chosen[name] = ladders[name][rung]
        passed_over = min(self.predicted) < best  # a lossy plan was faster, not by the margin
        reason = self._reason(layers, chosen, current, top, best_on_prior, passed_over)
        self.history.append([run.step, current if current < top else "dense", reason])
        return Plan.per_layer(chosen, reason=reason)

    def _worth_the_risk(self, ladders: dict[str, list[CompressorSpec]], candidates: list[dict[str, int]]) -> list[int]:
        """The shifts that may be chosen: every plan without a lossy layer, and a plan with
        one only if it is predicted ``lossy_margin`` faster than the fastest plan without
        (dense is always one): a lossy rung must buy a large speed-up."""
        first = self.ladders.first_near_lossless
        lossy = [any(rungs[n] < first(ladders[n]) for n in rungs) for rungs in candidates]
        bar = (1 - self.margin) * min(t for t, risky in zip(self.predicted, lossy, strict=True) if not risky)
        return [s for s, risky in enumerate(lossy) if not risky or self.predicted[s] <= bar]

    def _floor(self, name: str, ladder: list[CompressorSpec]) -> int:
        """The error floor, raised for a critical layer on a lossy rung by critical_boost
        rungs, but not past the first near-lossless rung; a layer on a near-lossless rung
        stays there."""
        floor = self.error_floor.get(name, 0)
        first = self.ladders.first_near_lossless(ladder)  # without near-lossless rungs: dense's index
        if self.critical.get(name) and self.boost and floor < first:
            floor = min(floor + self.boost, first)
        return min(floor, self.ladders.cap(ladder))

    def _detect(self, run: RunState, layers: dict[str, LayerHistory]) -> None:
        """Accordion's regime per layer, over the window that ended."""
        step, w = run.step, self.window
        measured = False
        for name, h in layers.items():
            cur = mean([v for s, v in h.grad_norm if step - w < s <= step])
            prev = mean([v for s, v in h.grad_norm if step - 2 * w < s <= step - w])
            if cur is not None:
                measured = True
                if prev is None:
                    self.critical[name] = True  # training starts in a critical regime
                elif prev > 0:
                    self.critical[name] = abs(prev - cur) / prev >= self.threshold
                else:
                    self.critical[name] = cur > 0
        if measured:  # a boundary before the first layer statistics detects again at the next
            self.last_detect = step

    def _judge_errors(self, run: RunState, layers: dict[str, LayerHistory]) -> None:
        """At every boundary: a layer whose error, averaged over the samples of the last
        window taken after its compressor family arrived or its floor last moved for error
        (at least ERROR_SAMPLES of them), exceeds max_error gets a higher floor: one rung
        lighter than the rung it was judged on, and out of the lossy rungs."""
        for name, h in layers.items():
            if name not in self.rungs:
                continue
            since = max(run.step - self.window, self.rung_since[name] + 2 * run.interval_steps)
            samples = [e for s, e in h.compression_error if s > since and e > 0]
            if len(samples) < ERROR_SAMPLES or sum(samples) / len(samples) <= self.max_error:
                continue
            ladder = self.ladders.ladder(h)
            raised = min(max(self.error_floor.get(name, 0), self.rungs[name]) + 1, len(ladder) - 1)
            first = self.ladders.first_near_lossless(ladder)
            if self.rungs_near_lossless and self.rungs[name] < first:  # out of the lossy rungs
                raised = max(raised, first)
            self.error_floor[name], self.rung_since[name] = raised, run.step  # judge anew from here

    def _reason(self, layers: dict[str, LayerHistory], chosen: dict[str, CompressorSpec],
                shift: int, top: int, best_on_prior: bool, passed_over: bool) -> str:
        """``best_on_prior``: the fastest candidate holds a family priced at round_seconds;
        ``passed_over``: a faster plan with a lossy layer fell short of ``lossy_margin``."""
        bw, compute = self.cost.bw, self.cost.compute
        assert bw is not None and compute is not None
        dense_s, best_s = self.predicted[top], self.predicted[shift]
        ratio = (dense_s - compute) / compute if compute > 0 else math.inf
        link = f"{'slow' if ratio >= 1 else 'fast'} link {bw / 1e6:.3g} MB/s, comm {ratio:.2g}x compute"
        if not chosen:
            lightest = min(self.predicted[:top]) if top else dense_s
            prior = (f" (within {PRIOR_BAND * self.slack:.0%} on the assumed round overhead)"
                     if lightest < dense_s and best_on_prior else "")
            return f"{link} → dense: compressed {lightest * 1e3:.3g} ms vs dense {dense_s * 1e3:.3g} ms{prior}"
        groups: dict[str, list[str]] = {}
        for name, spec in sorted(chosen.items()):
            groups.setdefault(label(spec), []).append(name)
        parts = [f"{text} on {len(names)}" for text, names in
                 sorted(groups.items(), key=lambda g: (-len(g[1]), g[0]))]
        critical = sum(1 for n in layers if self.critical.get(n))
        raised = sum(1 for n in layers if self.error_floor.get(n))
        dense = len(layers) - len(chosen)
        extras = [f"{critical} critical"] if critical else []
        extras += [f"{raised} lighter for error"] if raised else []
        extras += [f"{dense} dense"] if dense else []
        extras += ["lossy rungs off"] if not self.lossy and not self.sharded else []
        extras += [f"lossy not {self.margin:.0%} faster"] if passed_over else []
        tail = f" ({', '.join(extras)})" if extras else ""
        return f"{link} → {'; '.join(parts)}{tail}; {best_s * 1e3:.3g} ms vs dense {dense_s * 1e3:.3g} ms"

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_detect": self.last_detect, "critical": dict(self.critical),
            "error_floor": dict(self.error_floor), "rungs": dict(self.rungs),
            "rung_since": dict(self.rung_since), "floors": dict(self.floors), "shift": self.shift,
            "dense_chosen": self.dense_chosen, "prior_families": sorted(self.prior_families),
            "strikes": self.strikes, "switches": self.switches, "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any], legacy_families: tuple[str, ...]) -> None:
        """``legacy_families``: what an older snapshot's boolean ``on_prior`` stood for."""
        self.last_detect = state["last_detect"]
        self.critical = {k: bool(v) for k, v in state["critical"].items()}
        self.error_floor = {k: int(v) for k, v in state["error_floor"].items()}
        self.rungs = {k: int(v) for k, v in state["rungs"].items()}
        self.rung_since = {k: int(v) for k, v in state["rung_since"].items()}
        self.floors = {k: int(v) for k, v in state["floors"].items()}
        self.shift, self.dense_chosen = state["shift"], bool(state["dense_chosen"])
        self.prior_families = (set(state["prior_families"]) if "prior_families" in state
                               else set(legacy_families) if state.get("on_prior") else set())
        self.strikes, self.switches = int(state["strikes"]), int(state["switches"])
        self.history = deque((list(h) for h in state["history"]), maxlen=HISTORY)


__all__ = ["ERROR_SAMPLES", "PATIENCE", "PRIOR_BAND", "Chooser"]
