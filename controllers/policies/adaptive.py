"""The default policy: compress only as much as the measured link makes worth it.

It combines three measurements the controller already has (options:
``raycomp.config.AdaptivePolicy``; derivation of the cost model: ``docs/cost-model.md``)::

    link (every boundary, from the Timing deltas; per rank and step):
        dense interval (wire >= 95% of dense bytes):  1 / bw <- EMA(comm_seconds / wire)
        compressed interval, per collective family f (PowerSGD, Top-K, the quantized batch,
        each cast) in it, rounds_f extra rounds each:  residual = max(0, comm - wire / bw)
            expected_f = rounds_f * overhead_f (a family not measured yet: rounds_f * the
                mean of the measured families' overheads, round_seconds before any)
            overhead_f <- EMA(overhead_f, residual * expected_f / sum(expected) / rounds_f)
                (the first sample of a family is taken as it is; one family in the
                interval: residual / rounds_f)
        compute <- EMA(compute_seconds)
        (``bandwidth`` set: bw is that, never measured)
    ladder per compressible layer (heaviest first, dense last):
        lossy rungs, unless lossy is "never" (raycomp.train sets it for an optimizer whose
        update is not linear in the gradient, e.g. AdamW):
            matrix: powersgd r for r in ranks (only ranks whose factors are smaller)
            other (1-D, or PowerSGD cannot shrink it): topk ratio for ratio in topk_ratios
        then the near-lossless rungs (near_lossless: int4, int8, bf16), then dense
        (sharded, i.e. FSDP: only the near-lossless rungs and dense, bytes at (W-1)/W per
        element, no extra rounds: every unit sends one all-to-all whatever it carries)
    regime (every window_steps; Accordion, per layer):
        cur, prev = mean grad norm over the last two windows
        critical = no prev  or  |prev - cur| / prev >= threshold
    error (every boundary, per layer): the mean measured compression error of its rung over
        the last window (>= 2 samples taken after the rung arrived) > max_error  =>  the
        layer leaves the lossy rungs for good: error_floor = max(max(error_floor, its rung)
        + 1, first near-lossless rung) (on a near-lossless rung: one rung lighter)
    floor = error_floor; for a critical layer (critical_boost > 0) on a lossy rung:
        + critical_boost, but at most the first near-lossless rung (int4); a layer on a
        near-lossless rung stays there; never above cap = the last near-lossless rung (bf16)
    candidates s = 0, 1, ..., S - 1: a level on every ladder, which a floor only raises:
        rung(l, s) = min(max(floor_l, level_l(s)), cap_l), where with k_l lossy rungs and
        K = max(k_l) level_l(s) = s within the lossy rungs (s < k_l), then the first
        near-lossless rung up to s = K, then one rung per shift: the near-lossless rungs
        sit at the same shifts on every ladder (int4 at K, int8 at K + 1, ...). s = S:
        every layer dense (S = K + the number of near-lossless rungs; without them cap_l
        is dense and S = K)
        predicted(s) = compute + bytes(s) / bw + sum over its families of rounds_f *
            overhead_f (round_seconds for a family not measured yet)
        bytes: dense 2(W-1)/W * 4n; PowerSGD 2(W-1)/W * 4 (rows + cols) r; Top-K (W-1) * 8 k;
               int8 2(W-1)/W * (n + 8 n / 2048); int4 2(W-1)/W * (n / 2 + 8 n / 2048);
               bf16 2(W-1)/W * 2n
        extra_rounds: 2 with any PowerSGD layer (P and Q), 1 with any Top-K layer, 2 with any
               int8 or int4 layer (one batch: all-to-all and all-gather; at W = 2 one
               all-gather), 1 with any bf16 layer (its own all-reduce)
    eligible: every s whose plan has no layer on a lossy rung, and an s with one only when
        predicted(s) <= (1 - lossy_margin) * min(predicted over the plans without one)
        (lossy compression must buy a large speed-up for the accuracy it may cost)
    choice: target = the lightest eligible s with predicted(s) <= (1 + slack) * best, best =
        min(predicted over the eligible); while the fastest eligible candidate holds a family
        priced at the assumed round_seconds, dense also when predicted(dense) <= (1 +
        PRIOR_BAND * slack) * best (a saving predicted on a guess must be larger before
        compression is started on it)
        first decision, and the first after a family the choice in force was priced on the
        assumed round_seconds for has been measured: target (no hysteresis); floors changed
        (a regime window ended, or a layer's error moved it): with a floor raised, the
        lightest of target and the first shift that leaves every layer whose floor did not
        change on its rung or a lighter one, so layers that move lighter never push the
        others heavier; with none raised (layers calmed down), target;
        otherwise keep the current s while it is within that band, else switch to target
        once PATIENCE consecutive boundaries say so

Dense is the last candidate, so "don't compress" is an outcome whenever compression saves
less than ``slack`` (Agarwal et al., "On the Utility of Gradient Compression in Distributed
Training Systems", MLSys 2022: it paid off in 6 of 200+ data-center setups). PowerSGD is the
matrix compressor (Vogels et al., NeurIPS 2019): fixed tiny payload, all-reduced, so its
bytes per rank do not grow with the number of ranks, unlike Top-K's all-gather. Critical
layers get lighter compression (Agarwal et al., "Adaptive Gradient Communication via
Critical Learning Regime Identification", MLSys 2021). Until a dense interval has been
timed (no warm-up) the plan stays dense: that interval measures the link.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from controllers.policies.base import Policy
from controllers.state import LayerHistory, RunState
from raycomp.compressors.minmax import MinMaxInt4, MinMaxInt8
from raycomp.plan import DENSE, CompressorSpec, Plan

PATIENCE = 2  # consecutive boundaries outside the band before a link-driven switch
#: Until a compressed interval has measured the round overhead, compression must save this
#: many slacks against dense (among compressed plans the band stays one slack). The prior
#: (round_seconds) prices latency; what a compressed round costs here also holds its codec
#: and the overlap it loses: measured 46 ms a bf16 round on the fast link and about 200 ms
#: an int8 round at 100 Mbit/s, against the 1 ms assumed. On the prior the fast link chose
#: bf16 for a predicted 9-10% saving and then measured it 3-5% slower than dense. The
#: savings slow links offer (int8 at 100 Mbit/s: 570 ms against dense's 1.49 s) clear this
#: band by far.
PRIOR_BAND = 2
SMOOTHING = 0.5  # EMA weight of the newest measurement
DENSE_SHARE = 0.95  # an interval whose wire bytes are >= this share of dense bytes is dense
HISTORY = 32
#: the quantized rungs at their default chunk (2,048 elements: 2 fp32 bounds each)
QUANTIZERS = {q.name: q() for q in (MinMaxInt4, MinMaxInt8)}
ERROR_SAMPLES = 2  # error samples of a rung (one per control interval) before it is judged
LOWRANK, ALLGATHER, DENSE_FAMILY = "powersgd", "topk", "none"
QUANTIZED, CASTS = tuple(QUANTIZERS), ("bf16", "fp16")  # the near-lossless rungs
#: extra collective rounds per family, beyond the dense all-reduce the measured bandwidth includes
#: (the quantized rungs share one scalable collective, at W = 2 one all-gather; see
#: raycomp.collectives.ScalableAllreduce)
SCALABLE = "quantized"  # the quantized rungs' one batch of the scalable transport
EXTRA_ROUNDS = {LOWRANK: 2, ALLGATHER: 1, SCALABLE: 2, **dict.fromkeys(CASTS, 1)}
FAMILIES = tuple(EXTRA_ROUNDS)  # the collective families, each with its own round overhead


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        self.ranks = sorted({int(r) for r in options["ranks"]})
        self.ratios = sorted({float(r) for r in options["topk_ratios"]})
        self.near_lossless = [str(n) for n in options["near_lossless"]]
        self.lossy = options.get("lossy", "auto") != "never"  # "auto" unresolved: as "always"
        self.sharded = bool(options.get("sharded", False))
        self.threshold = float(options["threshold"])
        self.window = int(options["window_steps"])
        self.boost = int(options["critical_boost"])
        self.max_error = float(options["max_error"])
        self.slack = float(options["slack"])
        self.margin = float(options["lossy_margin"])
        self.assumed_bw = None if options.get("bandwidth") is None else float(options["bandwidth"])
        # measurements (per rank, per step)
        self.bw: float | None = self.assumed_bw
        self.prior = float(options["round_seconds"])  # a family's round until it is measured
        #: collective family -> seconds an extra round of it costs, measured. Per family: on
        #: the CNN at 100 Mbit/s a round of int4 cost 90-121 ms (its codec, and the overlap it
        #: loses), one of PowerSGD 18-38 ms (one DDP bucket); 12-25 ms and under 1 ms with
        #: about 8 buckets. Priced with int4's figure, PowerSGD rank 1 predicted 309 ms
        #: against int4's 310 and the policy never ran it. A family not measured yet is
        #: priced at round_seconds: optimistic, so that it is tried once
        self.overhead: dict[str, float] = {}
        self.compute: float | None = None
        self.seen_step = -1  # latest Timing step taken into the estimates
        # regimes and floors
        self.last_detect: int | None = None
        self.critical: dict[str, bool] = {}
        self.error_floor: dict[str, int] = {}
        self.rungs: dict[str, int] = {}  # layer -> rung in the latest plan
        #: layer -> step from which its error samples are judged: when its compressor family
        #: was decided, or its last error judgement (a rank change within PowerSGD does not
        #: restart it, see _judge_errors)
        self.rung_since: dict[str, int] = {}
        self.floors: dict[str, int] = {}  # layer -> floor rung at the latest decision
        # the choice
        self.shift: int | None = None  # None: nothing decided yet
        self.dense_chosen = False
        #: the families of the choice in force that were priced at round_seconds
        self.prior_families: set[str] = set()
        self.strikes = 0
        self.switches = 0
        self.predicted: list[float] = []
        self.history: deque[list[Any]] = deque(maxlen=HISTORY)  # [step, choice, reason]
        self._specs: dict[tuple[str, float], CompressorSpec] = {}

    # --- the decision --------------------------------------------------------------------
    def decide(self, run: RunState) -> Plan | None:
        self._measure(run)
        layers = self._compressible(run)
        if not layers:
            return Plan(reason="adaptive: no layer large enough to compress")
        if self.bw is None or self.compute is None:
            return Plan(reason="adaptive: dense until a dense interval has timed the link")
        if self.last_detect is None or run.step - self.last_detect >= self.window:
            self._detect(run, layers)
        self._judge_errors(run, layers)
        ladders = {name: self._ladder(run, h) for name, h in layers.items()}
        floors = {name: self._floor(name, ladders[name]) for name in layers}
        # the all-dense shift: one past the shift that puts every layer on its lightest
        # compressed rung (with near-lossless rungs: bf16 everywhere is a candidate of its own)
        levels = max(self._first_near_lossless(ladders[n]) for n in layers)  # K: the most lossy rungs
        top = levels + len(self.near_lossless)
        candidates = [{n: self._rung(ladders[n], floors[n], s, levels, top) for n in layers}
                      for s in range(top + 1)]
        priced = [self._predict(run, layers, ladders, rungs) for rungs in candidates]
        self.predicted = [seconds for seconds, _ in priced]
        eligible = self._worth_the_risk(ladders, candidates)
        fastest = min(eligible, key=self.predicted.__getitem__)
        best = self.predicted[fastest]
        within = [s for s in eligible if self.predicted[s] <= (1 + self.slack) * best]
        best_on_prior = bool(self._on_prior(priced[fastest][1]))
        if best_on_prior and self.predicted[top] <= (1 + PRIOR_BAND * self.slack) * best:
            within.append(top)  # on the assumed overhead compression must save more to be used
        target = max(within)
        current = None if self.shift is None else (top if self.dense_chosen else min(self.shift, top))
        if current is None or self.prior_families & self.overhead.keys():
            # the first decision, or the first since a family the choice in force was priced
            # on the assumed round_seconds for has been measured: that choice rested on a
            # guess, so it gets no hysteresis (on the fast link the prior chose bf16, then
            # kept it for 30 steps at 493 ms predicted against dense's 490 ms, because both
            # lay within the slack)
            current, self.strikes = target, 0
        elif floors != self.floors:
            # a regime or error change moves the layers it concerns. Layers that move lighter
            # must not make the others (floor unchanged) heavier: that waits for the
            # link-driven rule below. With no floor raised (layers calmed down) nothing
            # moved lighter, and the choice is made afresh
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
        self.prior_families = self._on_prior(priced[current][1])
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
        reason = self._reason(run, layers, chosen, current, top, best_on_prior, passed_over)
        self.history.append([run.step, current if current < top else "dense", reason])
        return Plan.per_layer(chosen, reason=reason)

    def _worth_the_risk(self, ladders: dict[str, list[CompressorSpec]],
                        candidates: list[dict[str, int]]) -> list[int]:
        """The shifts that may be chosen: every plan without a lossy layer, and a plan with
        one (PowerSGD, Top-K) only if it is predicted ``lossy_margin`` faster than the
        fastest plan without (the near-lossless rungs or dense, which is always one). A
        lossy rung can cost accuracy the others do not, so it must buy a large speed-up. On
        the character LSTM at 100 Mbit/s PowerSGD rank 4 was predicted 23% under int4 (75
        against 98 ms) and missed the loss target on every seed, where int4 matched dense;
        on the Fashion-MNIST CNN it is 36-45% under int4 (115-135 against 205-240 ms), and
        torch's rank 4 reached the target at int4's steps on 2 seeds of 3."""
        lossy = [any(rungs[n] < self._first_near_lossless(ladders[n]) for n in rungs) for rungs in candidates]
        bar = (1 - self.margin) * min(t for t, risky in zip(self.predicted, lossy, strict=True) if not risky)
        return [s for s, risky in enumerate(lossy) if not risky or self.predicted[s] <= bar]

    def _cap(self, ladder: list[CompressorSpec]) -> int:
        """The lightest rung a floor or a compressed shift reaches: the last near-lossless
        rung (bf16). Dense is only the all-dense candidate (and the guard's fallback): bf16
        and int8 reached dense's loss to 4 digits on the transformer, at 2/3 of its step at
        100 Mbit/s. Without near-lossless rungs, dense."""
        return len(ladder) - (2 if self.near_lossless else 1)

    def _first_near_lossless(self, ladder: list[CompressorSpec]) -> int:
        """The first near-lossless rung (int4 by default), right after the lossy ones."""
        return len(ladder) - 1 - len(self.near_lossless)

    def _floor(self, name: str, ladder: list[CompressorSpec]) -> int:
        """The error floor, raised for a critical layer (Accordion's "light compression in a
        critical regime"): critical_boost rungs lighter (rank 1 -> rank 4 with the default
        ranks, Accordion's own pair), but not past the first near-lossless rung. On the CNN
        (SGD) torch's PowerSGD rank 4 from step 20 reached the target at the same steps as
        int4 on 2 seeds of 3 at half int4's step, while int4 through the critical start cost
        adaptive 40 steps at twice PowerSGD's step (1.26x torch's time to target; 1.02x with
        this rule). On the character LSTM (SGD) adaptive ends 0.9% above dense's validation
        loss with it (medians of 3 seeds: 1.682 against 1.668); runs of one seed differ by
        about 0.01, since the plans follow measured timings. The transformer, where PowerSGD
        rank 8 through the critical start cost validation loss, trains with AdamW: its
        ladders hold no lossy rungs (``lossy``), so its critical layers sit on int4 as
        before. A near-lossless rung is light already, so a layer on one (after its error,
        or with no lossy rungs) stays there: boosting it put FSDP's critical units and
        error-floored layers on bf16."""
        floor = self.error_floor.get(name, 0)
        first = self._first_near_lossless(ladder)  # without near-lossless rungs: dense's index
        if self.critical.get(name) and self.boost and floor < first:
            floor = min(floor + self.boost, first)
        return min(floor, self._cap(ladder))

    def _rung(self, ladder: list[CompressorSpec], floor: int, shift: int, levels: int, top: int) -> int:
        """The shift is a level, the same on every ladder for the near-lossless rungs, and
        the floor a minimum: a layer above the level stays on its floor. Added to the floor
        instead, a shift of 2 (PowerSGD rank 4 for the others) sent a layer whose PowerSGD
        error moved it to int4 on to bf16, twice int4's bytes: on the CNN three layers ran
        bf16 for 20 steps at ~670 ms predicted. ``levels``: the most lossy rungs a ladder has."""
        if shift >= top:
            return len(ladder) - 1
        lossy = self._first_near_lossless(ladder)  # this ladder's lossy rungs
        level = shift if shift < lossy else lossy + max(0, shift - levels)
        return min(max(floor, level), self._cap(ladder))

    # --- measurements ----------------------------------------------------------------------
    def _measure(self, run: RunState) -> None:
        timings = [t for t in run.timings if t.step > self.seen_step]
        if not timings:
            return
        index = len(run.timings) - len(timings)
        previous = run.timings[index - 1] if index > 0 else None
        per_rank = max(1, run.world_size)
        for t in timings:
            if previous is None:  # the run's first report: totals count from zero
                steps, wire, dense = t.step + 1, t.wire_bytes, t.dense_bytes
            else:
                steps = t.step - previous.step
                wire, dense = t.wire_bytes - previous.wire_bytes, t.dense_bytes - previous.dense_bytes
            previous = t
            self.seen_step = t.step
            if steps <= 0 or wire < 0 or dense <= 0:
                continue  # a restart reset the totals, or nothing was sent: no sample
            wire, dense = wire / (per_rank * steps), dense / (per_rank * steps)
            self.compute = _ema(self.compute, max(0.0, t.compute_seconds))
            if wire >= DENSE_SHARE * dense:
                if self.assumed_bw is None and t.comm_seconds > 0:
                    # average seconds per byte, not bytes per second: one slow interval
                    # after a fast one must weigh as much as the other way round
                    per_byte = _ema(None if self.bw is None else 1 / self.bw, t.comm_seconds / wire)
                    self.bw = 1 / per_byte
            elif self.bw is not None and t is run.timings[-1]:
                # the layers' compressor names are those of this (the latest) interval
                rounds = self._rounds({h.compressor for h in run.layers.values()}, run.world_size)
                if rounds:
                    self._measure_rounds(rounds, max(0.0, t.comm_seconds - wire / self.bw))

    def _measure_rounds(self, rounds: dict[str, int], residual: float) -> None:
        """Share one interval's communication beyond its bytes (``residual``) among the
        collective families that ran in it (``rounds``: family -> extra rounds), in
        proportion to what each is expected to cost. A family not measured yet is expected
        to cost what a round of the measured ones does on average (``round_seconds`` before
        any): given only what the measured ones left unexplained, a bf16 layer that arrived
        beside PowerSGD ones on the CNN got 0 ms a round and looked free."""
        seed = _mean(list(self.overhead.values())) or self.prior
        expected = {f: r * self.overhead.get(f, seed) for f, r in rounds.items()}
        total = sum(expected.values())
        for f, r in rounds.items():
            share = expected[f] / total if total > 0 else r / sum(rounds.values())
            self.overhead[f] = _ema(self.overhead.get(f), share * residual / r)

    def _detect(self, run: RunState, layers: dict[str, LayerHistory]) -> None:
        """Accordion's regime per layer, over the window that ended."""
        step, w = run.step, self.window
        for name, h in layers.items():
            cur = _mean([v for s, v in h.grad_norm if step - w < s <= step])
            prev = _mean([v for s, v in h.grad_norm if step - 2 * w < s <= step - w])
            if cur is not None:
                if prev is None:
                    self.critical[name] = True  # training starts in a critical regime
                elif prev > 0:
                    self.critical[name] = abs(prev - cur) / prev >= self.threshold
                else:
                    self.critical[name] = cur > 0
        self.last_detect = step

    def _judge_errors(self, run: RunState, layers: dict[str, LayerHistory]) -> None:
        """At every boundary: a layer whose error, averaged over the samples of the last
        window taken after its compressor family arrived or its floor last moved for error
        (at least ERROR_SAMPLES of them), exceeds max_error gets a higher floor. No need to
        wait for the regime window: the error of a rung does not depend on a comparison
        between windows. A PowerSGD rank that the link-driven shift changes does not restart
        the count: on the transformer the shift moved 12 layers r2 -> r1 -> r4 every 20-30
        steps, each rank too short-lived for two settled samples, and the layers ran
        PowerSGD from step 59 to 149 before one was judged, its error over 0.9 by then (a
        higher rank barely lowers that error, see max_error)."""
        for name, h in layers.items():
            if name not in self.rungs:
                continue
            since = max(run.step - self.window, self.rung_since[name] + 2 * run.interval_steps)
            samples = [e for s, e in h.compression_error if s > since and e > 0]
            if len(samples) < ERROR_SAMPLES or sum(samples) / len(samples) <= self.max_error:
                continue
            ladder = self._ladder(run, h)
            # one rung lighter than the rung it was judged on (its floor could lie below it:
            # a layer on int8 for the critical start went back to PowerSGD rank 2 this way)
            raised = min(max(self.error_floor.get(name, 0), self.rungs[name]) + 1, len(ladder) - 1)
            first = self._first_near_lossless(ladder)
            if self.near_lossless and self.rungs[name] < first:  # out of the lossy rungs
                raised = max(raised, first)
            self.error_floor[name], self.rung_since[name] = raised, run.step  # judge anew from here

    # --- the cost model ---------------------------------------------------------------------
    def _compressible(self, run: RunState) -> dict[str, LayerHistory]:
        return {n: h for n, h in run.layers.items() if h.numel >= max(1, self.min_numel)}

    def _spec(self, family: str, value: float = 0.0) -> CompressorSpec:
        key = (family, value)
        if key not in self._specs:
            if family == LOWRANK:
                self._specs[key] = CompressorSpec.of(LOWRANK, rank=int(value))
            elif family == ALLGATHER:
                self._specs[key] = CompressorSpec.of(ALLGATHER, ratio=value)
            else:  # a near-lossless rung: no parameter
                self._specs[key] = CompressorSpec.of(family)
        return self._specs[key]

    def _ladder(self, run: RunState, h: LayerHistory) -> list[CompressorSpec]:
        rows, cols = _matrix(h)
        ranks = [r for r in self.ranks if (rows + cols) * min(r, rows, cols) < rows * cols]
        lossy = ([] if self.sharded or not self.lossy else [self._spec(LOWRANK, r) for r in ranks] if ranks
                 else [self._spec(ALLGATHER, r) for r in self.ratios])
        return [*lossy, *(self._spec(n) for n in self.near_lossless), DENSE]

    def _predict(self, run: RunState, layers: dict[str, LayerHistory], ladders: dict[str, list[CompressorSpec]],
                 rungs: dict[str, int]) -> tuple[float, dict[str, int]]:
        """The predicted step of the plan that puts each compressible layer on ``rungs``, and
        its collective families' extra rounds."""
        w = max(1, run.world_size)
        allreduce = (w - 1) / w if self.sharded else 2 * (w - 1) / w  # times each element is sent
        families = set()
        total = 0.0
        for name, h in run.layers.items():
            element = _element_bytes(h, w, allreduce)
            if name not in layers:
                total += allreduce * element * h.numel
                families.add(DENSE_FAMILY)
                continue
            spec = ladders[name][rungs[name]]
            families.add(spec.name)
            if spec.name == LOWRANK:
                rows, cols = _matrix(h)
                total += allreduce * 4 * (rows + cols) * min(dict(spec.params)["rank"], rows, cols)
            elif spec.name == ALLGATHER:
                k = max(1, min(h.numel, math.ceil(dict(spec.params)["ratio"] * h.numel)))
                total += (w - 1) * k * (element + 4)
            elif spec.name in QUANTIZED:  # packed codes, an fp32 (min, max) per chunk
                total += allreduce * QUANTIZERS[spec.name].wire_bytes(h.numel)
            elif spec.name in CASTS:
                total += allreduce * 2 * h.numel
            else:
                total += allreduce * element * h.numel
        assert self.bw is not None and self.compute is not None
        rounds = self._rounds(families, w)
        seconds = sum(r * self.overhead.get(f, self.prior) for f, r in rounds.items())
        return self.compute + total / self.bw + seconds, rounds

    def _rounds(self, families: set[str], world_size: int) -> dict[str, int]:
        """Collective rounds beyond dense's per family; none on the sharded path (one
        all-to-all a unit)."""
        return {} if self.sharded else _family_rounds(families, world_size)

    def _on_prior(self, rounds: dict[str, int]) -> set[str]:
        """The families among ``rounds`` still priced at the assumed round_seconds."""
        return {f for f in rounds if f not in self.overhead}

    def _reason(self, run: RunState, layers: dict[str, LayerHistory], chosen: dict[str, CompressorSpec],
                shift: int, top: int, best_on_prior: bool, passed_over: bool) -> str:
        """``best_on_prior``: the fastest candidate holds a family priced at round_seconds;
        ``passed_over``: a faster plan with a lossy layer fell short of ``lossy_margin``."""
        assert self.bw is not None and self.compute is not None
        dense_s, best_s = self.predicted[top], self.predicted[shift]
        ratio = (dense_s - self.compute) / self.compute if self.compute > 0 else math.inf
        link = f"{'slow' if ratio >= 1 else 'fast'} link {self.bw / 1e6:.3g} MB/s, comm {ratio:.2g}x compute"
        if not chosen:
            lightest = min(self.predicted[:top]) if top else dense_s
            prior = (f" (within {PRIOR_BAND * self.slack:.0%} on the assumed round overhead)"
                     if lightest < dense_s and best_on_prior else "")
            return f"{link} → dense: compressed {lightest * 1e3:.3g} ms vs dense {dense_s * 1e3:.3g} ms{prior}"
        groups: dict[str, list[str]] = {}
        for name, spec in sorted(chosen.items()):
            groups.setdefault(_label(spec), []).append(name)
        parts = [f"{label} on {len(names)}" for label, names in
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
        return (f"{link} → {'; '.join(parts)}{tail}; "
                f"{best_s * 1e3:.3g} ms vs dense {dense_s * 1e3:.3g} ms")

    # --- reporting and state -------------------------------------------------------------------
    def details(self) -> dict[str, Any]:
        return {
            "bandwidth_bytes_per_s": self.bw, "bandwidth_assumed": self.assumed_bw is not None,
            "round_overhead_s": dict(self.overhead), "round_overhead_measured": bool(self.overhead),
            "compute_s": self.compute, "predicted_step_s": list(self.predicted),
            "shift": self.shift, "dense": self.dense_chosen, "switches": self.switches, "lossy": self.lossy,
            "critical_layers": sorted(n for n, c in self.critical.items() if c),
            "error_floor": dict(self.error_floor), "last_detection_step": self.last_detect,
            "history": list(self.history),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "bw": self.bw, "overhead": dict(self.overhead),
            "compute": self.compute, "seen_step": self.seen_step, "last_detect": self.last_detect,
            "critical": dict(self.critical), "error_floor": dict(self.error_floor),
            "rungs": dict(self.rungs), "rung_since": dict(self.rung_since), "floors": dict(self.floors),
            "shift": self.shift,
            "dense_chosen": self.dense_chosen, "prior_families": sorted(self.prior_families),
            "strikes": self.strikes, "switches": self.switches,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return  # nothing saved yet: start fresh
        self.bw = state["bw"] if self.assumed_bw is None else self.assumed_bw
        overhead = state["overhead"]
        if isinstance(overhead, dict):
            self.overhead = {str(f): float(v) for f, v in overhead.items()}
        else:  # before 2026-11-24: one figure for every family, measured or still the prior
            self.overhead = dict.fromkeys(FAMILIES, float(overhead)) if state["overhead_measured"] else {}
        self.compute, self.seen_step = state["compute"], int(state["seen_step"])
        self.last_detect = state["last_detect"]
        self.critical = {k: bool(v) for k, v in state["critical"].items()}
        self.error_floor = {k: int(v) for k, v in state["error_floor"].items()}
        self.rungs = {k: int(v) for k, v in state["rungs"].items()}
        self.rung_since = {k: int(v) for k, v in state["rung_since"].items()}
        self.floors = {k: int(v) for k, v in state["floors"].items()}
        self.shift, self.dense_chosen = state["shift"], bool(state["dense_chosen"])
        # absent before 2026-11-23; "on_prior" (a bool: the choice rested on the prior) before 2026-11-24
        self.prior_families = (set(state["prior_families"]) if "prior_families" in state
                               else set(FAMILIES) if state.get("on_prior") else set())
        self.strikes, self.switches = int(state["strikes"]), int(state["switches"])
        self.history = deque((list(h) for h in state["history"]), maxlen=HISTORY)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _family_rounds(families: set[str], world_size: int) -> dict[str, int]:
    """Collective rounds beyond the dense all-reduce (which the measured bandwidth includes),
    per collective family of the compressors named in ``families``."""
    rounds = {**EXTRA_ROUNDS, SCALABLE: 1} if world_size == 2 else EXTRA_ROUNDS
    # int4 and int8 layers travel in one batch of the scalable transport: its rounds once
    batches = {SCALABLE if f in QUANTIZED else f for f in families}
    return {b: rounds[b] for b in sorted(batches) if rounds.get(b)}


def _matrix(h: LayerHistory) -> tuple[int, int]:
    """PowerSGD's matrix view (first dim x rest); a square guess without a shape."""
    if h.shape is None:
        side = max(1, math.isqrt(h.numel))
        return side, max(1, h.numel // side)
    if len(h.shape) < 2:
        return 1, h.numel  # a vector: factors are never smaller
    return h.shape[0], h.numel // max(1, h.shape[0])


def _element_bytes(h: LayerHistory, world_size: int, allreduce: float) -> float:
    """Bytes per gradient element from the measured dense bytes (the sum over the ranks of
    one step), rounded to 2, 4 or 8; 4 (fp32) before any measurement."""
    if h.dense_bytes <= 0 or not h.numel or allreduce <= 0:
        return 4.0
    measured = h.dense_bytes / (world_size * allreduce * h.numel)
    return min((2.0, 4.0, 8.0), key=lambda size: abs(size - measured))


def _label(spec: CompressorSpec) -> str:
    params = dict(spec.params)
    if spec.name == LOWRANK:
        return f"powersgd r={params['rank']}"
    if spec.name == ALLGATHER:
        return f"topk {params['ratio']:g}"
    return spec.name
