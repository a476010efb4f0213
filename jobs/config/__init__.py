"""The configuration of a training job (``python -m jobs.train``), loaded from YAML plus
``key=value`` overrides and checked before any cluster resource is taken.

Unknown keys, wrong types, out-of-range values and missing data sets raise
:class:`~raycomp.config.ConfigError` with the dotted key that is wrong and what is allowed.
YAML is parsed with ``yaml.safe_load`` only: a config is data, never code. The sections a
worker reads (compression, controller, checkpoint) are raycomp's own (:mod:`raycomp.config`).
"""

from jobs.config.job_sections import (
    DDP_BASELINES,
    FSDP_BASELINES,
    WORKLOAD_MODELS,
    BenchmarkSection,
    JobConfig,
    RunSection,
    ScalingSection,
    WorkloadSection,
    resolve_entrypoint,
)
from jobs.config.loading import (
    apply_overrides,
    load_config,
    parse_override,
    read_yaml_mapping,
    validate,
)
from jobs.config.preflight import (
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
from raycomp.config import ConfigError, one_line

__all__ = [
    "DDP_BASELINES", "DIGITS_TRAIN_EXAMPLES", "FSDP_BASELINES", "WORKLOAD_MODELS",
    "BenchmarkSection", "ConfigError", "JobConfig", "RunSection", "ScalingSection", "WorkloadSection",
    "apply_overrides", "check_cluster_fits", "check_controller_paths", "check_metrics_endpoint",
    "check_resources", "check_sizes", "check_writable_dir", "check_writable_file", "load_config",
    "local_cpus", "one_line", "parse_override", "read_yaml_mapping", "resolve_entrypoint",
    "train_examples", "validate",
]
