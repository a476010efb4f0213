"""Local steps: ranks train apart for H steps, then merge through an outer optimizer step
on the averaged, compressed pseudo-gradient (DiLoCo, Streaming DiLoCo)."""

from raycomp._internal.local.inner_state import equalize_inner_state
from raycomp._internal.local.schedule import FragmentSchedule, resolve_delay, split_fragments
from raycomp._internal.local.steps import BUFFER_MODES, LocalSteps, nesterov_outer

__all__ = ["BUFFER_MODES", "FragmentSchedule", "LocalSteps", "equalize_inner_state", "nesterov_outer",
           "resolve_delay", "split_fragments"]
