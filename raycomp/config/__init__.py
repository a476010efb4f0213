"""Typed, validated configuration for a training run, loaded from YAML plus overrides.

Everything is checked before any cluster resource is taken: unknown keys, wrong types,
out-of-range values and missing data sets raise :class:`ConfigError` with the dotted key
that is wrong and what is allowed. YAML is parsed with ``yaml.safe_load`` only: a config
is data, never code.
"""

from raycomp.config.base import (
    WORKLOADS,
    CompressorConfig,
    ConfigError,
    compressor,
    one_line,
)
from raycomp.config.loading import (
    apply_overrides,
    load_config,
    parse_override,
    read_yaml_mapping,
    validate,
)
from raycomp.config.preflight import (
    DIGITS_TRAIN_EXAMPLES,
    check_cluster_fits,
    check_controller_paths,
    check_metrics_endpoint,
    check_resources,
    check_sizes,
    check_writable_dir,
    check_writable_file,
    local_cpus,
    train_examples,
)
from raycomp.config.sections import (
    WORKLOAD_MODELS,
    CheckpointSection,
    CompressionSection,
    ControllerSection,
    FaultsSection,
    GuardSection,
    JobConfig,
    LrScalingSection,
    RunSection,
    ScalingSection,
    WorkloadSection,
    host_literal,
    resolve_entrypoint,
)

__all__ = [
    "WORKLOADS", "WORKLOAD_MODELS", "DIGITS_TRAIN_EXAMPLES",
    "CheckpointSection", "CompressionSection", "CompressorConfig",
    "ConfigError", "ControllerSection", "FaultsSection",
    "GuardSection", "JobConfig", "LrScalingSection", "RunSection", "ScalingSection", "WorkloadSection",
    "apply_overrides", "check_cluster_fits", "check_controller_paths", "check_metrics_endpoint",
    "check_resources", "check_sizes", "check_writable_dir", "check_writable_file", "compressor",
    "host_literal", "load_config", "local_cpus", "one_line", "parse_override", "read_yaml_mapping",
    "resolve_entrypoint", "train_examples", "validate",
]
