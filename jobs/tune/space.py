"""The search space: ``{section: {key: {choice: [...]}}}`` in a tune config, checked,
flattened to dotted job-config keys, and turned into Tune's domains and trial configs."""

from __future__ import annotations

import copy
from typing import Any

from jobs.config import ConfigError, JobConfig, validate

__all__ = ["DENSE", "DOMAINS", "check_domain", "domain_values", "flatten_search", "set_key", "to_tune_domain",
           "trial_config"]

DOMAINS = ("choice", "uniform", "loguniform", "randint", "lograndint")
#: the ``dense`` baseline's changes to the base config: plain all-reduce from the first step
DENSE = {"compression.policy": "static", "compression.static.compressor": {"name": "none"},
         "compression.warmup_steps": 0}


def flatten_search(tree: Any, prefix: str = "") -> dict[str, tuple[str, Any]]:
    """Nested ``{section: {key: {choice: [...]}}}`` -> ``{"section.key": ("choice", [...])}``."""
    where = f"search.{prefix}" if prefix else "search"
    if not isinstance(tree, dict):
        raise ConfigError(f"{where}: expected a mapping of config keys, got {tree!r}")
    kinds = [k for k in tree if k in DOMAINS]
    if kinds:
        if len(tree) != 1:
            raise ConfigError(f"{where}: a search domain has exactly one key ({', '.join(DOMAINS)}), "
                              f"got {sorted(tree)}")
        kind = kinds[0]
        return {prefix: (kind, check_domain(where, kind, tree[kind]))}
    out: dict[str, tuple[str, Any]] = {}
    for key, child in tree.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{where}: {key!r} is not a config key")
        path = f"{prefix}.{key}" if prefix else key
        if not isinstance(child, dict):
            raise ConfigError(f"search.{path}: expected a domain such as {{choice: [a, b]}}, "
                              f"{{uniform: [lo, hi]}}, {{loguniform: [lo, hi]}} or {{randint: [lo, hi]}}, "
                              f"got {child!r}")
        out.update(flatten_search(child, path))
    return out


def check_domain(where: str, kind: str, args: Any) -> Any:
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.choice: expected a non-empty list of values, got {args!r}")
        return args
    if not (isinstance(args, list) and len(args) == 2
            and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)):
        raise ConfigError(f"{where}.{kind}: expected [low, high], got {args!r}")
    low, high = args
    if kind in ("randint", "lograndint") and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}.{kind}: expected integers [low, high], got {args!r}")
    if not low < high:
        raise ConfigError(f"{where}.{kind}: low must be < high, got {args!r}")
    if kind in ("loguniform", "lograndint") and low <= 0:
        raise ConfigError(f"{where}.{kind}: low must be > 0 on a log scale, got {args!r}")
    return [low, high]


def domain_values(kind: str, args: Any) -> list[Any]:
    """The values a domain can produce that bound it (every choice, both ends of a range)."""
    return list(args)


def to_tune_domain(kind: str, args: Any) -> Any:
    from ray import tune

    if kind == "choice":
        return tune.choice(args)
    if kind == "uniform":
        return tune.uniform(*args)
    if kind == "loguniform":
        return tune.loguniform(*args)
    if kind == "randint":
        return tune.randint(args[0], args[1] + 1)  # inclusive here, exclusive in Tune
    return tune.lograndint(args[0], args[1] + 1)


def set_key(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = data
    parts = dotted.split(".")
    for key in parts[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {key!r} is not a section")
        node = child
    node[parts[-1]] = copy.deepcopy(value)
    return data


def trial_config(base: dict[str, Any], variant: str, params: dict[str, Any]) -> JobConfig:
    """The job config a trial trains with."""
    data = copy.deepcopy(base)
    changes = DENSE if variant == "dense" else {} if variant == "default" else params
    for key, value in changes.items():
        set_key(data, key, value)
    return validate(data)
