"""Compression policies by name (``compression.policy`` in the job config).

A policy is named by a built-in name (:data:`POLICIES`), a name given to
:func:`register_policy` in this process, or an import path ``"package.module:Class"``,
imported on first use by the process that runs it (the controller actor): the robust way
across processes. A name registered in the driver is turned into its class's import path
when a job config is validated with :data:`REGISTRY` (``context=raycomp.config.policy_context(REGISTRY)``,
as ``jobs.config.validate`` and ``raycomp.train.TrainOptions`` pass it), so the controller
imports it too (the class must live in an importable module, not ``__main__``).

A policy's typed options are its ``options_model`` (a pydantic model, best a
:class:`PolicyOptions`): a built-in policy's come from ``compression.<name>``, any other's
from ``compression.custom_options``; :func:`make_policy` hands the policy the validated
object. A built-in policy's options model lives with the job config, in
:mod:`raycomp.config.policy_options` (re-exported here). A new built-in policy is one module
here, its line in :data:`REGISTRY`, and its options model in
:data:`raycomp.config.policy_options.POLICY_OPTIONS`.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, ValidationError

from raycomp._internal.registry import Registry
from raycomp.config import LocalSection
from raycomp.config.base import one_line
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

from .adaptive import AdaptivePolicy
from .bandwidth import BandwidthPolicy
from .base import MIN_COMPRESS_NUMEL, Policy
from .critical import CriticalPolicy
from .decision import Decision, Said, Why
from .error_budget import ErrorBudgetPolicy
from .fallback_gate import FallbackGate
from .local import LocalChoice
from .schedule import SchedulePolicy
from .static import StaticPolicy


def _check_class(name: str, cls: Any) -> type[Policy]:
    if not (inspect.isclass(cls) and issubclass(cls, Policy)):
        raise ValueError(f"policy {name!r}: {cls!r} is not a subclass of raycomp.controllers.policies.Policy")
    if inspect.isabstract(cls):
        raise ValueError(f"policy {name!r}: {cls.__name__} does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))}")
    model = cls.options_model
    if model is not None and not (inspect.isclass(model) and issubclass(model, BaseModel)):
        raise ValueError(f"policy {name!r}: {cls.__name__}.options_model must be a pydantic model class, "
                         f"got {model!r}")
    return cls


#: every policy by name: built in (one line each), registered in this process, or by import path
REGISTRY: Registry[Policy] = Registry("policy", "compression.policy", [
    StaticPolicy,
    SchedulePolicy,
    CriticalPolicy,
    ErrorBudgetPolicy,
    BandwidthPolicy,
    AdaptivePolicy,
], _check_class)
#: the built-in policies by name
POLICIES: dict[str, type[Policy]] = REGISTRY.builtins


def register_policy(name: str, policy: type[Policy] | str, *, replace: bool = False) -> None:
    """Make ``compression.policy: name`` use ``policy`` (a :class:`Policy` subclass or its
    import path ``"package.module:Class"``), its options validated by the class's
    ``options_model``.

    Per process, like :func:`raycomp.compressors.register`; job configs validated after
    this call accept ``name`` and send the controller the class's import path.
    """
    REGISTRY.register(name, policy, replace=replace)


def unregister_policy(name: str) -> None:
    """Forget a name given to :func:`register_policy` (built-in names stay)."""
    REGISTRY.unregister(name)


def policy_class(name: str) -> type[Policy]:
    """The class of a policy name (built in, registered or import path)."""
    return REGISTRY.get(name)


def options_key(name: str) -> str:
    """Where a policy's options sit in a job config."""
    return f"compression.{name}" if name in POLICIES else "compression.custom_options"


def validate_options(name: str, options: Any) -> Any:
    """``options`` (a mapping) as the typed options of policy ``name``: an instance of its
    ``options_model`` (ValueError: one line naming the key), or as given without one."""
    model = policy_class(name).options_model
    if model is None or isinstance(options, model):
        return options
    try:
        return model.model_validate(options)
    except ValidationError as error:
        raise ValueError(one_line(error, prefix=f"{options_key(name)}.")) from None


def make_policy(name: str, options: dict[str, Any], gate: bool = True) -> Policy:
    """The policy ``name`` with its options (the mapping a job config's section dumps to;
    ``min_compress_numel`` rides along, and ``local``, ``compression.local``, when its mode is
    not off: the policy is then wrapped in :class:`LocalChoice`), wrapped in
    :class:`FallbackGate` unless ``gate=False``."""
    own = {k: v for k, v in options.items() if k not in ("min_compress_numel", "local")}
    policy = policy_class(name)(validate_options(name, own),
                                int(options.get("min_compress_numel", MIN_COMPRESS_NUMEL)))
    if options.get("local") is not None:  # compression.local rides along when not off
        policy = LocalChoice(policy, LocalSection.model_validate(options["local"]))
    return FallbackGate(policy) if gate else policy


__all__ = [
    "POLICIES", "REGISTRY", "AdaptiveOptions", "AdaptivePolicy", "BandwidthOptions", "BandwidthPolicy",
    "CriticalOptions", "CriticalPolicy", "Decision", "ErrorBudgetOptions", "ErrorBudgetPolicy", "FallbackGate", "LocalChoice", "Policy",
    "PolicyOptions", "Said", "ScheduleOptions", "SchedulePolicy", "ScheduleStage", "StaticOptions", "StaticPolicy", "Why",
    "make_policy", "options_key", "policy_class", "register_policy", "unregister_policy", "validate_options",
]
