"""The worker-side guard: fall back to dense all-reduce when training goes wrong.

Every rank runs the same :class:`Guard` on the same inputs — the norm of the reduced
gradient (the same tensor on every rank) and a few floats of every rank that rode inside
the step's gradient collective (non-finite flag; loss and worst compression error, one
step late) — so every rank takes the same decision in the same step without asking the
controller and without a collective of its own (see :mod:`raycomp._internal.train.step_judge`):

* a non-finite gradient; a gradient norm above ``grad_norm_factor`` x the recent norms;
  a loss spike over a window: the mean loss of the last ``spike_steps`` steps above
  ``loss_spike_factor`` x the level of the ``loss_window`` losses before them; or a
  relative compression error above ``max_compression_error`` (of the applied mean:
  :mod:`raycomp._internal.reduce.mean_error`). "Level" is the window's
  ``spike_quantile`` (90th percentile), not its median, and the loss is averaged over
  a few steps, because per-batch losses late in training are small and heavy-tailed:
  one hard batch is not a divergence, a sustained rise is;
  switches to dense from the next step (non-finite and exploding steps are also
  skipped: the optimizer must not apply them);
* after ``stable_steps`` clean steps compression resumes (hysteresis).

These rules judge what raycomp changes: they act only while raycomp compresses or runs
local steps (``compressing``), where falling back to dense helps. Under a dense plan a run
trains exactly as plain DDP: no rule fires, no step is skipped but one whose gradient is
not finite (as torch's GradScaler skips it), and the windows keep filling, so that the
first compressed steps are judged against the dense steps before them.

A gradient norm counts as exploding only above ``grad_norm_factor`` x the recent level
*and* above the highest level the run has trained through (:attr:`Guard.peak_norm_level`):
late in training, with norms a hundredth of the early ones, one hard batch moves the norm
tenfold against its tiny recent level and is not a divergence.

Every switch is an event with its step and reason.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Guard", "GuardEvent", "REASONS", "Verdict"]

REASONS = ("nonfinite_gradient", "gradient_explosion", "loss_spike", "compression_error")


@dataclass(frozen=True)
class GuardEvent:
    step: int
    kind: str  # "fallback" | "recovered"
    reason: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    skip_update: bool  # do not apply this step's gradients
    changed: bool  # fallback started or ended at this step


class Guard:
    def __init__(
        self,
        enabled: bool = True,
        loss_spike_factor: float = 3.0,
        loss_window: int = 20,
        max_compression_error: float = 2.0,
        stable_steps: int = 50,
        grad_norm_factor: float = 10.0,
        spike_quantile: float = 0.9,
        spike_steps: int = 5,
    ) -> None:
        self.enabled = enabled
        self.loss_spike_factor = loss_spike_factor
        self.grad_norm_factor = grad_norm_factor
        self.spike_quantile = spike_quantile
        self.recent_losses: deque[float] = deque(maxlen=spike_steps)
        self.grad_norms: deque[float] = deque(maxlen=loss_window)
        self.max_compression_error = max_compression_error
        self.stable_steps = stable_steps
        self.losses: deque[float] = deque(maxlen=loss_window)
        #: the highest level of :attr:`grad_norms` seen in the run: the norms it trained through
        self.peak_norm_level = 0.0
        self.active = False
        self.reason = ""
        self.clean_steps = 0
        self.events: list[GuardEvent] = []

    def observe(self, step: int, nonfinite: bool, loss: float | None, max_error: float | None,
                grad_norm: float | None = 0.0, compressing: bool = True) -> Verdict:
        """One step's decision. ``loss`` None: no loss to judge at this step (the first step,
        or the loss belonged to a skipped step); ``max_error`` None: not measured;
        ``grad_norm`` None: no reduced gradient to judge (a sync of local steps);
        ``compressing`` False: the step ran under a dense plan the guard did not impose
        (plain DDP: only a non-finite gradient is skipped, nothing falls back)."""
        if not self.enabled:
            return Verdict(skip_update=nonfinite, changed=False)
        if not compressing and not self.active:
            if nonfinite:
                return Verdict(skip_update=True, changed=False)
            if loss is not None and math.isfinite(loss):
                self.recent_losses.append(loss)
            self._remember(loss, grad_norm)
            return Verdict(skip_update=False, changed=False)
        trigger = self._trigger(nonfinite, loss, max_error, grad_norm)
        if trigger is not None:
            reason, detail = trigger
            skip = reason in ("nonfinite_gradient", "gradient_explosion")
            return Verdict(skip_update=skip, changed=self._fall_back(step, reason, detail))
        self._remember(loss, grad_norm)
        if self.active:
            self.clean_steps += 1
            if self.clean_steps >= self.stable_steps:
                self.active = False
                detail = f"{self.clean_steps} clean steps"
                self.events.append(GuardEvent(step, "recovered", self.reason, detail))
                return Verdict(skip_update=False, changed=True)
        return Verdict(skip_update=False, changed=False)

    def observe_error(self, step: int, max_error: float, where: str = "") -> Verdict:
        """A compression error measured apart from any step's judgement (the applied mean's,
        at an agreement: :mod:`raycomp._internal.reduce.mean_error`; ``where``: the layer and step it was
        measured at): above ``max_compression_error`` it falls back from the step after
        ``step``; otherwise nothing changes (it is no clean step towards a recovery)."""
        if not self.enabled or not max_error > self.max_compression_error:
            return Verdict(skip_update=False, changed=False)
        detail = self._error_detail(max_error) + (f" ({where})" if where else "")
        return Verdict(skip_update=False, changed=self._fall_back(step, "compression_error", detail))

    def _error_detail(self, max_error: float) -> str:
        return f"relative error {max_error:.4g} > {self.max_compression_error}"

    def _fall_back(self, step: int, reason: str, detail: str) -> bool:
        """Dense from the next step, the clean count restarted; whether the fallback began here."""
        changed = not self.active
        if changed:
            self.active, self.reason = True, reason
            self.events.append(GuardEvent(step, "fallback", reason, detail))
        self.clean_steps = 0
        return changed

    def _remember(self, loss: float | None, grad_norm: float | None) -> None:
        """A clean step's loss and norm join the windows the rules compare against."""
        if loss is not None and math.isfinite(loss):
            self.losses.append(loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
            level = self.level(self.grad_norms)
            if level is not None:
                self.peak_norm_level = max(self.peak_norm_level, level)

    def _trigger(self, nonfinite: bool, loss: float | None, max_error: float | None,
                 grad_norm: float | None) -> tuple[str, str] | None:
        if nonfinite or (loss is not None and (loss != loss or loss in (float("inf"), float("-inf")))):
            return "nonfinite_gradient", "NaN/Inf in gradients or loss"
        if grad_norm is not None and grad_norm > self.peak_norm_level and \
                (level := self.spike_level(grad_norm, self.grad_norms, self.grad_norm_factor)) is not None:
            return "gradient_explosion", (
                f"gradient norm {grad_norm:.4g} > {self.grad_norm_factor} x recent level {level:.4g} "
                f"and above the run's highest level {self.peak_norm_level:.4g}")
        if loss is not None:
            self.recent_losses.append(loss)
        recent = sum(self.recent_losses) / len(self.recent_losses) if self.recent_losses else 0.0
        if loss is not None and (level := self.spike_level(recent, self.losses, self.loss_spike_factor)) is not None:
            return "loss_spike", (f"mean loss of the last {len(self.recent_losses)} steps {recent:.4g} > "
                                  f"{self.loss_spike_factor} x recent level {level:.4g}")
        if max_error is not None and max_error > self.max_compression_error:
            return "compression_error", self._error_detail(max_error)
        return None

    def level(self, window: deque[float]) -> float | None:
        """The window's ``spike_quantile`` (None under 3 values)."""
        if len(window) < 3:
            return None
        ordered = sorted(window)
        return ordered[min(len(ordered) - 1, int(self.spike_quantile * len(ordered)))]

    def spike_level(self, value: float, window: deque[float], factor: float) -> float | None:
        """The window's level if ``value`` is more than ``factor`` x it, else None."""
        level = self.level(window)
        return level if level is not None and level > 0 and value > factor * level else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "peak_norm_level": self.peak_norm_level,
            "recent_losses": list(self.recent_losses),
            "active": self.active,
            "reason": self.reason,
            "clean_steps": self.clean_steps,
            "events": [e.to_dict() for e in self.events],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.grad_norms.clear()
        self.grad_norms.extend(state["grad_norms"])
        # a checkpoint from before the peak: the level of the window it holds
        self.peak_norm_level = float(state.get("peak_norm_level", self.level(self.grad_norms) or 0.0))
        self.recent_losses.clear()
        self.recent_losses.extend(state["recent_losses"])
        self.active = state["active"]
        self.reason = state["reason"]
        self.clean_steps = state["clean_steps"]
        self.events = [GuardEvent(**e) for e in state["events"]]
