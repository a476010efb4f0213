"""How often ranks talk, beside how hard: per-step compression or local steps.

:class:`LocalChoice` wraps the run's policy (which keeps deciding the per-step plan) when
``compression.local.mode`` is ``fixed`` or ``auto``:

* ``fixed``: every plan after the warm-up is local steps every ``sync_every`` steps, the
  pseudo-gradients compressed with ``compressor``.
* ``auto``: the predicted step of the inner policy's per-step plan against local steps'
  ``compute + stall / H`` (a sync's seconds that the ``delay``'s inner steps do not hide;
  with two levels an inner step's all-reduce inside the node counts as compute).
  H is the smallest power of two whose stall adds at most ``target_overhead`` of the
  compute, never above what the learning rate allows (``sync_every_at_peak_lr x (peak /
  lr)^2``, Gu et al. 2024's quadratic rule). Local steps are entered when per step is
  predicted ``min_gain`` slower and kept while it is slower at all; a switch of mode or H
  waits for ``PATIENCE`` boundaries that agree.

A guard fallback under local steps, or (auto) a loss that falls ``loss_tolerance`` behind
its best at ``PATIENCE`` boundaries, halves the largest H; ``RECOVERY`` calm boundaries
double it again. Under local steps the per-step cost models learn nothing; this policy
measures instead an inner step's compute and a sync's cost against the byte model, and,
where syncs overlap inner steps, the slowdown they cause, from a *probe* at twice the H
(``compute(H) = inner + slowdown / H``). The rules and their grounds:
``docs/cost-model.md`` ("Local steps: how often ranks talk").
"""

from __future__ import annotations

from typing import Any

from raycomp._internal.local import resolve_delay
from raycomp.config import LOCAL_MIN_GAIN, LocalSection
from raycomp.plan import CompressorSpec, LocalMode, Plan

from ..state import RunState
from .base import Policy, compressible_layers
from .cost_model import CostModel
from .decision import Decision, Said, checked
from .local_state import LocalRecord, LocalState, Measured, Sample
from .local_why import LocalFixedWhy, LocalWhy

__all__ = ["PATIENCE", "LocalChoice", "replica_share"]

PATIENCE = 2  # boundaries in a row that must agree before a change of mode or H
MEASURED_BOUNDARIES = 16  # the latest boundaries under one H that a sync's cost is measured over
RECOVERY = 10  # calm boundaries in a row after which a lowered largest H doubles again


class LocalChoice(Policy):
    """Args:
        inner: the policy that decides per-step plans (and is consulted every boundary).
        options: ``compression.local`` (``mode`` fixed or auto).
    """

    def __init__(self, inner: Policy, options: LocalSection) -> None:
        super().__init__(inner.options, inner.min_numel)
        self.inner, self.local = inner, options
        self.name = inner.name
        self.cost = CostModel(round_seconds=0.001)
        self.state: LocalState = LocalState(ceiling=options.max_sync_every, cost=self.cost.state)

    def restored(self) -> None:
        self.cost.state = self.state.cost

    def decide(self, run: RunState) -> Decision | None:
        local_in_force = run.plan.local_steps is not None
        if local_in_force:  # timings of inner steps and syncs: not per-step figures
            self._freeze(run)
        else:
            self.cost.measure(run)
        decision = checked(self.inner.decide(run), self.name)
        if decision is not None:
            self.state.last = decision.plan
        ceiling = self.state.ceiling
        if run.fallback_events > self.state.fallbacks_seen:
            if local_in_force and self.state.chosen:
                self.state.ceiling = max(1, self.state.chosen // 2)
                self.state.history.append(LocalRecord(run.step, self.state.chosen, "step back",
                                                      f"largest H now {self.state.ceiling}"))
            self.state.fallbacks_seen = run.fallback_events
        pseudo = CompressorSpec.of(self.local.compressor)
        if local_in_force and self.local.mode == "auto" and not run.fallback_active:
            self._measure_local(run, pseudo)
            self._follow_loss(run)
        else:  # steps outside local steps: the next H takes its own samples, from its second boundary
            self.state.best_loss, self.state.behind, self.state.sampled_h, self.state.measured = None, 0, 0, None
        self._recover(run, stepped_back=self.state.ceiling < ceiling)
        if self.local.mode == "fixed":
            return Decision.of(Plan(default=pseudo, local=LocalMode(self.local.sync_every, self.local.fragments)),
                               LocalFixedWhy(self.local.sync_every, str(pseudo)))
        return self._auto(run, pseudo)

    def warmup(self, run: RunState) -> Decision | None:
        """Per step during the warm-up, as the inner policy says: local steps wait for its end."""
        return self.inner.warmup(run)

    def _auto(self, run: RunState, pseudo: CompressorSpec) -> Decision | None:
        s, base = self.state, self.state.last
        if base is None or not self.cost.ready:
            return None if base is None else Decision.of(base, Said("local.unpriced", base.reason))
        layers = compressible_layers(run, self.min_numel)
        per_step, _ = self.cost.predict(run, {n: base.spec_for(n) for n in layers})
        # a node replica's inner step all-reduces inside the node: priced at the node's link
        # until an inner step is measured (its compute then holds it)
        inside = self.cost.node_allreduce(run) if s.inner_compute is None else 0.0
        compute = (self.cost.compute or 0.0) + inside if s.inner_compute is None else s.inner_compute
        sync = self._predicted_sync(run, pseudo) * (1.0 if s.sync_scale is None else s.sync_scale)
        allowed = self._lr_allows(run)
        by_time = self._interval(sync, compute)
        h = by_time if allowed is None else self._interval(sync, compute, allowed)
        stall = self._stall(sync, compute, h) if h else 0.0
        local_step = compute + stall / h if h else per_step
        min_gain = self._min_gain()
        # entering local steps takes min_gain; staying takes only being faster (a band, so that a
        # ratio near 1 + min_gain does not switch back and forth, each switch a merge)
        staying = bool(s.chosen)
        gain = 0.0 if staying else min_gain
        target = h if h and per_step > (1 + gain) * local_step else 0
        probe = self._probe(target, allowed)
        held = not probe and s.probing > 0 and s.probing == s.chosen and not self._measured(s.chosen) \
            and (allowed is None or s.chosen <= allowed)
        if probe:
            s.chosen, s.wanted, s.strikes, s.probing = probe, None, 0, probe
        elif held:  # a probe stays until its step is measured
            s.wanted, s.strikes = None, 0
        elif s.chosen is None or target == s.chosen or (allowed is not None and s.chosen > allowed):
            s.chosen, s.wanted, s.strikes = target, None, 0
        else:
            s.strikes = s.strikes + 1 if target == s.wanted else 1
            s.wanted = target
            if s.strikes >= PATIENCE:
                s.chosen, s.wanted, s.strikes = target, None, 0
        chosen = s.chosen or 0
        rule = "local.per_step" if not chosen else "local.probe" if probe else \
            "local.measuring" if held else "local.steps"
        why = LocalWhy(
            rule=rule, h=chosen, pseudo=str(pseudo), per_step_reason=base.reason, per_step=per_step,
            local_step=local_step, compute=compute, sync=sync, stall=stall, candidate=h, by_time=by_time,
            lr_fraction=None if h == by_time else run.lr / run.peak_lr, min_gain=min_gain, staying=staying,
            sync_scale=s.sync_scale, slowdown=s.slowdown, slowdown_from=tuple(s.slowdown_from),
            probe_taken=(s.measured.compute + s.measured.wait if s.measured else 0.0) if probe else None,
            replicas=run.nodes, inside=inside)
        plan = base if not chosen else Plan(default=pseudo, local=LocalMode(chosen, self._fragments(chosen)))
        decision = Decision.of(plan, why)
        s.history.append(LocalRecord(run.step, chosen, target, decision.plan.reason))
        return decision

    def _fragments(self, h: int) -> int:
        """The fragments local steps at ``h`` sync in: the configured ones if they divide it."""
        return self.local.fragments if h % self.local.fragments == 0 else 1

    def _delay(self, h: int) -> int:
        """The inner steps a sync of local steps at ``h`` overlaps
        (:func:`raycomp._internal.local.resolve_delay`, as every rank resolves it)."""
        return resolve_delay(self.local.delay, h, self._fragments(h))

    def _probe(self, target: int, allowed: float | None) -> int:
        """The H to measure next, or 0: twice the H in force, where the choice would keep it,
        its step is measured, its syncs overlap inner steps, the slowdown they cause is not
        measured yet, and the ceiling, ``max_sync_every`` and the learning rate allow it."""
        h = self.state.chosen
        if not h or target != h or self.state.slowdown is not None or not self._measured(h):
            return 0
        if not self._delay(h):
            return 0  # a sync waited for at once is all in the wait: one H measures it
        largest = min(self.state.ceiling, self.local.max_sync_every, float("inf") if allowed is None else allowed)
        return 2 * h if 2 * h <= largest else 0

    def _measured(self, h: int) -> bool:
        """Whether ``h`` is in force and its latest boundaries have measured it."""
        return h == self.state.sampled_h and self.state.measured is not None and self.state.measured.h == h

    def _stall(self, sync: float, compute: float, h: int) -> float:
        """The seconds a sync of local steps at ``h`` holds training up. A measured sync
        already is that (its wait, after the inner steps it overlapped); a predicted one
        overlaps the delay's inner steps (:func:`raycomp._internal.local.resolve_delay`), each
        ``compute`` long, and holds up only what they do not cover."""
        if self.state.sync_scale is not None:
            return sync
        return max(0.0, sync - self._delay(h) * compute)

    def _predicted_sync(self, run: RunState, pseudo: CompressorSpec) -> float:
        """What the byte model predicts a sync costs: every compressible layer sent once as
        ``pseudo``, beyond the compute."""
        sent = dict.fromkeys(compressible_layers(run, self.min_numel), pseudo)
        return max(0.0, self.cost.predict(run, sent)[0] - (self.cost.compute or 0.0))

    def _measure_local(self, run: RunState, pseudo: CompressorSpec) -> None:
        """Take the latest boundary under local steps into the measured inner step and sync.
        The first boundary under a new H, or under the same H again after steps outside
        local steps, is left out (it holds the switch and steps of the plan before); over the
        rest, a sync costs the communication seconds per step x H."""
        mode = run.plan.local_steps
        latest = run.timings[-1] if run.timings else None
        if mode is None or latest is None or latest.step <= self.state.sampled_step or not self.cost.ready:
            return
        steps, self.state.sampled_step = latest.step - self.state.sampled_step, latest.step
        if mode.sync_every != self.state.sampled_h:
            self.state.sampled_h, self.state.samples = mode.sync_every, []
            return
        samples = [*self.state.samples, Sample(steps, latest.compute_seconds, latest.comm_seconds)]
        self.state.samples = samples[-MEASURED_BOUNDARIES:]
        covered = sum(x.steps for x in self.state.samples)
        predicted = self._predicted_sync(run, pseudo)
        if covered < 2 * mode.sync_every or predicted <= 0:
            return
        h = mode.sync_every
        compute = sum(x.steps * x.compute for x in self.state.samples) / covered
        wait = sum(x.steps * x.comm for x in self.state.samples) / covered
        before, self.state.measured = self.state.measured, Measured(h, compute, wait)
        overlapped = bool(self._delay(h))
        if self.state.slowdown is None and before is not None and before.h != h and overlapped:
            self._measure_slowdown(before.h, before.compute, h, compute)
        slowdown = self.state.slowdown if overlapped and self.state.slowdown is not None else 0.0
        self.state.inner_compute = compute - slowdown / h
        self.state.sync_scale = (wait * h + slowdown) / predicted

    def _measure_slowdown(self, a: int, compute_a: float, b: int, compute_b: float) -> None:
        """The seconds a sync adds to the inner steps it overlaps, from the compute a step
        under two H measured one after the other: ``compute(H) = inner + slowdown / H``. 0
        where the compute did not shrink with H, or would leave an inner step none (noise
        larger than the difference)."""
        if not self._delay(a):
            return  # the H before waited for its syncs: nothing overlapped to compare with
        slowdown = (compute_a - compute_b) / (1 / a - 1 / b)
        inner = compute_a - slowdown / a
        self.state.slowdown = slowdown if slowdown > 0 and inner > 0 else 0.0
        self.state.slowdown_from = sorted([a, b])

    def _lr_allows(self, run: RunState) -> float | None:
        """The largest H the learning rate allows: ``sync_every_at_peak_lr x (peak / lr)^2``
        for two replicas, less for more (:func:`replica_share`); None (no limit) when the
        workers report no rate, or it has decayed past 1e-4 of its peak (the cap would pass
        any H allowed, and its square could overflow)."""
        if run.lr is None or not run.peak_lr or run.lr <= 0:
            return None
        decay = run.peak_lr / run.lr
        if decay > 1e4:
            return None
        return self.local.sync_every_at_peak_lr * replica_share(run.nodes) * decay**2

    def _min_gain(self) -> float:
        """``min_gain`` as the worker resolved it; "auto" unresolved (a run registered
        without :func:`raycomp.train.prepare_model`): the cautious value, as for an Adam."""
        gain = self.local.min_gain
        return LOCAL_MIN_GAIN["other"] if gain == "auto" else float(gain)

    def _follow_loss(self, run: RunState) -> None:
        """Halve H when the loss has fallen behind at ``PATIENCE`` boundaries in a row."""
        losses = [loss for _, loss in list(run.losses)[-2:]]
        if not losses or not self.state.chosen:
            return
        mean_loss = sum(losses) / len(losses)
        if self.state.best_loss is None or mean_loss < self.state.best_loss:
            self.state.best_loss, self.state.behind = mean_loss, 0
            return
        limit = self.state.best_loss + self.local.loss_tolerance * abs(self.state.best_loss)
        self.state.behind = self.state.behind + 1 if mean_loss > limit else 0
        if self.state.behind < PATIENCE:
            return
        self.state.ceiling = max(1, self.state.chosen // 2)
        halved = self.state.ceiling if self.state.ceiling >= 2 else 0
        self.state.history.append(LocalRecord(
            run.step, self.state.chosen, halved,
            f"step back: loss {mean_loss:.4g} above {limit:.4g} (lowest since local steps {self.state.best_loss:.4g} + "
            f"{self.local.loss_tolerance:.0%}) at {PATIENCE} boundaries; largest H now {self.state.ceiling}"))
        self.state.chosen, self.state.wanted, self.state.strikes = halved, None, 0
        self.state.best_loss, self.state.behind = None, 0  # the next H starts its own record

    def _recover(self, run: RunState, stepped_back: bool) -> None:
        """Double a lowered largest H after ``RECOVERY`` calm boundaries in a row."""
        if self.state.ceiling >= self.local.max_sync_every or stepped_back or self.state.behind or run.fallback_active:
            self.state.calm = 0
            return
        self.state.calm += 1
        if self.state.calm >= RECOVERY:
            self.state.ceiling, self.state.calm = min(self.local.max_sync_every, 2 * self.state.ceiling), 0
            self.state.history.append(LocalRecord(
                run.step, self.state.chosen, "recover",
                f"largest H back to {self.state.ceiling} after {RECOVERY} boundaries without a step back"))

    def _interval(self, sync: float, compute: float, limit: float = float("inf")) -> int:
        """The smallest power-of-two H whose sync's stall adds at most ``target_overhead`` of
        the compute per step, else the largest allowed (by the ceiling, ``max_sync_every`` and
        ``limit``); 0 when local steps are not allowed."""
        largest = min(self.state.ceiling, self.local.max_sync_every, limit)
        candidates = [h for h in (2 ** k for k in range(1, 18)) if h <= largest]
        if not candidates:
            return 0
        for h in candidates:
            if self._stall(sync, compute, h) / h <= self.local.target_overhead * compute:
                return h
        return candidates[-1]

    def _freeze(self, run: RunState) -> None:
        if run.timings:
            latest = run.timings[-1].step
            for model in self.cost_models():
                model.skip_to(latest)

    def cost_models(self) -> list[CostModel]:
        return [self.cost, *self.inner.cost_models()]

    def details(self) -> dict[str, Any]:
        s = self.state
        return {**self.inner.details(), "local": {
            "mode": self.local.mode, "sync_every": s.chosen, "largest_allowed": s.ceiling,
            "inner_compute_s": s.inner_compute, "sync_scale": s.sync_scale, "slowdown_s": s.slowdown,
            "history": [[r.step, r.h, r.asked, r.reason] for r in s.history]}}


def replica_share(count: int) -> float:
    """The share of the two-replica H that keeps ``count`` replicas as close to their mean.

    Between syncs each replica's weights drift from the replicas' mean by its own gradient
    noise: after H inner steps the expected squared distance is ``(1 - 1/R) H eta^2
    sigma^2`` for R replicas (independent noise of variance sigma^2 at rate eta). The
    learning-rate rule's ``sync_every_at_peak_lr`` was set where R = 2; for R replicas the
    same distance takes ``H x (1/2) / (1 - 1/R)``: 2/3 of it at 4, 1/2 at many. On the
    BatchNorm CNN the two-replica schedule cost 0.45% accuracy at 4 replicas and none at 2.
    """
    return 1.0 if count <= 2 else 0.5 / (1 - 1 / count)
