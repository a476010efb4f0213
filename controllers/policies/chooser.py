"""The adaptive policy's chooser: regimes, error judging, the choice among the priced
candidate plans, and its hysteresis (the rules: ``docs/cost-model.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raycomp.plan import CompressorSpec, Plan

from ..state import LayerHistory, RunState
from .adaptive_why import AdaptiveWhy
from .cost_model import CostModel, mean
from .decision import Decision, Said
from .ladders import Ladders, label

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


@dataclass
class ChoiceRecord:
    """One decision: its boundary, the shift chosen ("dense": the all-dense plan), why."""

    step: int
    choice: int | str
    reason: str


@dataclass
class ChooserState:
    """Floors per layer, and the shift (a rung position on every ladder) of the plan in force."""

    # regimes and floors
    last_detect: int | None = None  # the boundary of the latest regime detection
    critical: dict[str, bool] = field(default_factory=dict)  # layer -> in a critical regime
    error_floor: dict[str, int] = field(default_factory=dict)  # layer -> lowest rung its error allows
    rungs: dict[str, int] = field(default_factory=dict)  # layer -> rung in the latest plan
    #: layer -> step from which its error samples are judged: when its compressor family
    #: was decided, or its last error judgement (a PowerSGD rank change does not restart it)
    rung_since: dict[str, int] = field(default_factory=dict)
    floors: dict[str, int] = field(default_factory=dict)  # layer -> floor rung at the latest decision
    # the choice
    shift: int | None = None  # None: nothing decided yet
    dense_chosen: bool = False
    prior_families: set[str] = field(default_factory=set)  # families of the choice in force priced on the prior
    strikes: int = 0  # boundaries in a row outside the band
    switches: int = 0
    predicted: list[float] = field(default_factory=list)  # each shift's predicted step at the latest decision
    history: list[ChoiceRecord] = field(default_factory=list)  # the latest HISTORY decisions


@dataclass(frozen=True)
class Menu:
    """The candidate plans of one decision: per shift (heaviest first, all-dense last) the
    rung of every layer, its predicted step and its families' extra rounds; the shifts
    within the band; the fastest eligible step, and whether it was priced on the prior."""

    candidates: list[dict[str, int]]
    predicted: list[float]
    rounds: list[dict[str, int]]
    top: int
    within: list[int]
    best: float
    best_on_prior: bool
    best_compressed: float | None  # the fastest eligible shift other than all dense


class Chooser:
    """Chooses a shift for every decision; what it learns is :class:`ChooserState`, part of
    its policy's state."""

    def __init__(self, options: AdaptiveOptions, cost: CostModel, min_numel: int) -> None:
        self.cost, self.min_numel = cost, min_numel
        self.lossy = options.lossy != "never"  # "auto" unresolved: as "always"
        self.sharded = options.sharded
        self.ladders = Ladders(options.ranks, options.topk_ratios, options.near_lossless, self.lossy, self.sharded)
        self.rungs_near_lossless = len(options.near_lossless)
        self.threshold, self.window = float(options.threshold), int(options.window_steps)
        self.boost, self.max_error = int(options.critical_boost), float(options.max_error)
        self.slack, self.margin = float(options.slack), float(options.lossy_margin)
        self.state = ChooserState()

    def decide(self, run: RunState) -> Decision:
        layers = {n: h for n, h in run.layers.items() if h.numel >= max(1, self.min_numel)}
        if not layers:
            return Decision.of(Plan(), Said("adaptive.nothing_to_compress",
                                            "adaptive: no layer large enough to compress"))
        if not self.cost.ready:
            return Decision.of(Plan(), Said("adaptive.unmeasured",
                                            "adaptive: dense until a dense interval has timed the link"))
        s = self.state
        if s.last_detect is None or run.step - s.last_detect >= self.window:
            self._detect(run, layers)
        self._judge_errors(run, layers)
        ladders = {name: self.ladders.ladder(h) for name, h in layers.items()}
        floors = {name: self._floor(name, ladders[name]) for name in layers}
        menu = self._menu(run, ladders, floors)
        current, rule = self._hysteresis(menu, floors)
        s.shift, s.dense_chosen, s.floors = current, current == menu.top, floors
        s.prior_families = self.cost.on_prior(menu.rounds[current])
        chosen: dict[str, CompressorSpec] = {}
        for name in layers:
            rung = menu.candidates[current][name]
            old = s.rungs.get(name)
            if old is None or ladders[name][old].name != ladders[name][rung].name:
                s.rung_since[name] = run.step
            s.rungs[name] = rung
            if not ladders[name][rung].is_dense:
                chosen[name] = ladders[name][rung]
        decision = Decision.of(Plan.per_layer(chosen), self._why(run, rule, layers, chosen, menu, current))
        record = ChoiceRecord(run.step, current if current < menu.top else "dense", decision.plan.reason)
        s.history = [*s.history, record][-HISTORY:]
        return decision

    def _menu(self, run: RunState, ladders: dict[str, list[CompressorSpec]], floors: dict[str, int]) -> Menu:
        """Every candidate shift priced, and which are in the band."""
        # the all-dense shift: one past the shift that puts every layer on its lightest
        # compressed rung (with near-lossless rungs: bf16 everywhere is a candidate of its own)
        most_lossy = max(self.ladders.first_near_lossless(ladder) for ladder in ladders.values())  # rungs
        top = most_lossy + self.rungs_near_lossless
        candidates = [{n: self.ladders.rung(ladders[n], floors[n], s, most_lossy, top) for n in ladders}
                      for s in range(top + 1)]
        priced = [self.cost.predict(run, {n: ladders[n][r] for n, r in rungs.items()}) for rungs in candidates]
        predicted = [seconds for seconds, _ in priced]
        self.state.predicted = predicted
        eligible = self._worth_the_risk(ladders, candidates)
        fastest = min(eligible, key=predicted.__getitem__)
        best = predicted[fastest]
        within = [s for s in eligible if predicted[s] <= (1 + self.slack) * best]
        best_on_prior = bool(self.cost.on_prior(priced[fastest][1]))
        if best_on_prior and predicted[top] <= (1 + PRIOR_BAND * self.slack) * best:
            within.append(top)  # on the assumed overhead compression must save more to be used
        compressed = [predicted[s] for s in eligible if s != top]
        return Menu(candidates, predicted, [rounds for _, rounds in priced], top, within, best, best_on_prior,
                    min(compressed) if compressed else None)

    def _hysteresis(self, menu: Menu, floors: dict[str, int]) -> tuple[int, str]:
        """The shift to take, and the rule that took it: the lightest within the band, unless
        the shift in force is kept (within the band, or outside it for fewer than PATIENCE
        boundaries) or a floor change moves it."""
        s, target = self.state, max(menu.within)
        current = None if s.shift is None else (menu.top if s.dense_chosen else min(s.shift, menu.top))
        if current is None or s.prior_families & self.cost.overhead.keys():
            # the first decision, or the first since a family the choice in force was priced
            # on the assumed round_seconds for has been measured: no hysteresis for a guess
            s.strikes = 0
            return target, "adaptive.first"
        if floors != s.floors:
            # a regime or error change moves the layers it concerns; layers that move lighter
            # must not make the others (floor unchanged) heavier. With no floor raised
            # (layers calmed down) the choice is made afresh
            raised = any(floors[n] > s.floors.get(n, floors[n]) for n in floors)
            kept = [n for n in floors if floors[n] == s.floors.get(n) and n in s.rungs] if raised else []
            lowest = next(i for i, rungs in enumerate(menu.candidates) if all(rungs[n] >= s.rungs[n] for n in kept))
            s.strikes = 0
            return max(target, lowest), "adaptive.floors"
        if current in menu.within:
            s.strikes = 0
            return current, "adaptive.band"
        s.strikes += 1
        if s.strikes < PATIENCE:
            return current, "adaptive.outside_band"
        s.strikes, s.switches = 0, s.switches + 1
        return target, "adaptive.switch"

    def _worth_the_risk(self, ladders: dict[str, list[CompressorSpec]], candidates: list[dict[str, int]]) -> list[int]:
        """The shifts that may be chosen: every plan without a lossy layer, and a plan with
        one only if it is predicted ``lossy_margin`` faster than the fastest plan without
        (dense is always one): a lossy rung must buy a large speed-up."""
        first = self.ladders.first_near_lossless
        lossy = [any(rungs[n] < first(ladders[n]) for n in rungs) for rungs in candidates]
        bar = (1 - self.margin) * min(t for t, risky in zip(self.state.predicted, lossy, strict=True) if not risky)
        return [s for s, risky in enumerate(lossy) if not risky or self.state.predicted[s] <= bar]

    def _floor(self, name: str, ladder: list[CompressorSpec]) -> int:
        """The error floor, raised for a critical layer on a lossy rung by critical_boost
        rungs, but not past the first near-lossless rung; a layer on a near-lossless rung
        stays there."""
        floor = self.state.error_floor.get(name, 0)
        first = self.ladders.first_near_lossless(ladder)  # without near-lossless rungs: dense's index
        if self.state.critical.get(name) and self.boost and floor < first:
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
                    self.state.critical[name] = True  # training starts in a critical regime
                elif prev > 0:
                    self.state.critical[name] = abs(prev - cur) / prev >= self.threshold
                else:
                    self.state.critical[name] = cur > 0
        if measured:  # a boundary before the first layer statistics detects again at the next
            self.state.last_detect = step

    def _judge_errors(self, run: RunState, layers: dict[str, LayerHistory]) -> None:
        """At every boundary: a layer whose error, averaged over the samples of the last
        window taken after its compressor family arrived or its floor last moved for error
        (at least ERROR_SAMPLES of them), exceeds max_error gets a higher floor: one rung
        lighter than the rung it was judged on, and out of the lossy rungs."""
        for name, h in layers.items():
            if name not in self.state.rungs:
                continue
            since = max(run.step - self.window, self.state.rung_since[name] + 2 * run.interval_steps)
            samples = [e for s, e in h.compression_error if s > since and e > 0]
            if len(samples) < ERROR_SAMPLES or sum(samples) / len(samples) <= self.max_error:
                continue
            ladder = self.ladders.ladder(h)
            raised = min(max(self.state.error_floor.get(name, 0), self.state.rungs[name]) + 1, len(ladder) - 1)
            first = self.ladders.first_near_lossless(ladder)
            if self.rungs_near_lossless and self.state.rungs[name] < first:  # out of the lossy rungs
                raised = max(raised, first)
            self.state.error_floor[name], self.state.rung_since[name] = raised, run.step  # judge anew from here

    def _why(self, run: RunState, rule: str, layers: dict[str, LayerHistory], chosen: dict[str, CompressorSpec],
             menu: Menu, shift: int) -> AdaptiveWhy:
        bw, compute = self.cost.bw, self.cost.compute
        assert bw is not None and compute is not None
        groups: dict[str, list[str]] = {}
        for name, spec in sorted(chosen.items()):
            groups.setdefault(label(spec), []).append(name)
        s = self.state
        return AdaptiveWhy(
            rule=rule, bandwidth=bw, compute=compute, predicted=tuple(menu.predicted), shift=shift, top=menu.top,
            groups=tuple((text, len(names)) for text, names in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0]))),
            critical=sum(1 for n in layers if s.critical.get(n)),
            raised=sum(1 for n in layers if s.error_floor.get(n)),
            dense_layers=len(layers) - len(chosen), lossy_off=not self.lossy and not self.sharded,
            prior_band=PRIOR_BAND * self.slack if menu.best_on_prior else None,
            # a faster plan with a lossy layer fell short of lossy_margin
            passed_over_margin=self.margin if min(menu.predicted) < menu.best else None,
            levels=(run.nodes, run.per_node) if run.per_node > 1 else None,
            node_link=None if run.node_link is None else 1 / run.node_link,
            best_compressed=menu.best_compressed, slack=self.slack)


__all__ = ["ERROR_SAMPLES", "PATIENCE", "PRIOR_BAND", "ChoiceRecord", "Chooser", "ChooserState"]
