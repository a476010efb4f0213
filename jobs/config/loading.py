"""Reading a job config: YAML (``safe_load``: data, never code), ``key=value`` overrides,
validation with one-line errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from jobs.config.job_sections import JobConfig
from raycomp.config import ConfigError, one_line, policy_context
from raycomp.controllers.policies import REGISTRY

__all__ = ["apply_overrides", "load_config", "parse_override", "read_yaml_mapping", "validate"]

# --- loading ---------------------------------------------------------------------------
_OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)=(.*)$", re.S)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as a YAML scalar/flow value)."""
    match = _OVERRIDE.match(text)
    if not match:
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. compression.policy=static")
    try:
        value = yaml.safe_load(match.group(2)) if match.group(2).strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({error.problem})") from None
    return match.group(1).split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {key!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                schema: type[JobConfig] = JobConfig) -> JobConfig:
    """Read YAML (optional), apply ``key=value`` overrides, validate as ``schema`` (a
    :class:`JobConfig`, or a subclass with more sections such as the fault drill's)."""
    data = read_yaml_mapping(path) if path is not None else {}
    return validate(apply_overrides(data, list(overrides)), schema)


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file whose top level is a mapping (``safe_load``: data, never code)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {error}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {str(path)!r}: top level must be a mapping of sections")
    return loaded or {}


def validate(data: dict[str, Any], schema: type[JobConfig] = JobConfig) -> JobConfig:
    """``data`` as a ``schema``; :class:`~raycomp.config.ConfigError` (one line) if it is not one."""
    try:
        return schema.model_validate(data, context=policy_context(REGISTRY))
    except ValidationError as error:
        raise ConfigError(one_line(error)) from None
