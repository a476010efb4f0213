"""Typed, validated configuration of what runs in a worker: the compression policy and its
options, the guard, the LR ramp, the controller link and checkpointing.

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` (or a
``ValueError`` from the section itself) with the dotted key that is wrong and what is
allowed. The built-in policies' options are here too (:mod:`raycomp.config.policy_options`);
a registered policy's are validated by its class's model (``raycomp.controllers.policies``). A
training job's whole config (run, workload, cluster shape) nests these sections; it lives
with the job (``jobs.config``).
"""

from raycomp.config.base import (
    CompressorConfig,
    ConfigError,
    compressor,
    one_line,
)
from raycomp.config.checkpoint import CheckpointSection
from raycomp.config.compression import CompressionSection
from raycomp.config.controller import ControllerSection, host_literal
from raycomp.config.guard import GuardSection
from raycomp.config.local import LOCAL_MIN_GAIN, LocalSection
from raycomp.config.lr_scaling import LrScalingSection
from raycomp.config.policy_options import (
    AdaptiveOptions,
    BandwidthOptions,
    CriticalOptions,
    ErrorBudgetOptions,
    PolicyOptions,
    ScheduleOptions,
    ScheduleStage,
    StaticOptions,
)
from raycomp.config.policy_sections import policy_context

__all__ = [
    "AdaptiveOptions", "BandwidthOptions", "CriticalOptions", "ErrorBudgetOptions", "PolicyOptions",
    "ScheduleOptions", "ScheduleStage", "StaticOptions",
    "CheckpointSection", "CompressionSection", "CompressorConfig", "ConfigError", "ControllerSection",
    "GuardSection", "LOCAL_MIN_GAIN", "LocalSection", "LrScalingSection", "compressor", "host_literal", "one_line",
    "policy_context",
]
