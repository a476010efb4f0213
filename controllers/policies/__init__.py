"""Compression policies by name (``compression.policy`` in the job config).

A policy is named by one of:

* a built-in name (:data:`POLICIES`);
* a name given to :func:`register_policy` in this process;
* an import path ``"package.module:Class"``, imported on first use by the process that
  runs it (the controller actor): the robust way across processes. A name registered in
  the driver is turned into its class's import path when the job config is validated, so
  the controller imports it too (the class must live in an importable module, not
  ``__main__``).

Options of a policy that is not built in come from ``compression.custom_options`` and are
validated by the policy's options model (a pydantic model: the ``options`` argument of
:func:`register_policy`, or the class attribute ``options_model``).
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, ValidationError

from controllers.policies.adaptive import AdaptivePolicy
from controllers.policies.bandwidth import BandwidthPolicy
from controllers.policies.base import Policy
from controllers.policies.critical import CriticalPolicy
from controllers.policies.error_budget import ErrorBudgetPolicy
from controllers.policies.guarded import Guarded
from controllers.policies.schedule import SchedulePolicy
from controllers.policies.static import StaticPolicy
from raycomp.compressors import IMPORT_PATH, NAME
from raycomp.config import CompressionSection, one_line
from raycomp.imports import import_object

POLICIES: dict[str, type[Policy]] = {
    "static": StaticPolicy,
    "schedule": SchedulePolicy,
    "critical": CriticalPolicy,
    "error_budget": ErrorBudgetPolicy,
    "bandwidth": BandwidthPolicy,
    "adaptive": AdaptivePolicy,
}
_REGISTERED: dict[str, tuple[type[Policy] | str, type[BaseModel] | None]] = {}
_IMPORTED: dict[str, type[Policy]] = {}


def register_policy(name: str, policy: type[Policy] | str, options: type[BaseModel] | None = None, *,
                    replace: bool = False) -> None:
    """Make ``compression.policy: name`` use ``policy`` (a :class:`Policy` subclass or its
    import path ``"package.module:Class"``), its options validated by ``options`` (a
    pydantic model; default: the class's ``options_model``, or none: options pass as given).

    Per process, like :func:`raycomp.compressors.register`; job configs validated after
    this call accept ``name`` and send the controller the class's import path.
    """
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"policy name {name!r}: expected letters, digits, '_', '.' or '-' "
                         "(at most 64, starting with a letter or '_')")
    if name in POLICIES:
        raise ValueError(f"policy name {name!r} is built in; choose another name")
    if isinstance(policy, str):
        if not IMPORT_PATH.match(policy):
            raise ValueError(f"policy {name!r}: {policy!r} is not an import path 'package.module:Class'")
    else:
        _check_class(name, policy)
    if options is not None and not (inspect.isclass(options) and issubclass(options, BaseModel)):
        raise ValueError(f"policy {name!r}: options must be a pydantic model class, got {options!r}")
    current = _REGISTERED.get(name)
    if current is not None and current != (policy, options) and not replace:
        raise ValueError(f"policy name {name!r} is already registered; pass replace=True to change it")
    _REGISTERED[name] = (policy, options)
    model = options if options is not None else (None if isinstance(policy, str) else policy.options_model)
    CompressionSection.custom_policies[name] = (_import_path(policy), model)


def unregister_policy(name: str) -> None:
    if name not in _REGISTERED:
        raise ValueError(f"policy name {name!r} is not registered; registered: "
                         f"{', '.join(sorted(_REGISTERED)) or '(none)'}")
    del _REGISTERED[name]
    CompressionSection.custom_policies.pop(name, None)


def policy_class(name: str) -> tuple[type[Policy], type[BaseModel] | None]:
    """The class and options model of a policy name (built in, registered or import path)."""
    if name in POLICIES:
        return POLICIES[name], None  # built-in options are validated by raycomp.config
    if name in _REGISTERED:
        target, options = _REGISTERED[name]
        cls = _import(name, target) if isinstance(target, str) else target
        return cls, options if options is not None else cls.options_model
    if isinstance(name, str) and IMPORT_PATH.match(name):
        cls = _import(name, name)
        return cls, cls.options_model
    users = f", {', '.join(sorted(_REGISTERED))}" if _REGISTERED else ""
    raise ValueError(f"compression.policy: unknown {name!r}; allowed: {', '.join(POLICIES)}{users}, "
                     "or an import path 'package.module:Class'")


def make_policy(name: str, options: dict[str, Any], guard: bool = True) -> Policy:
    """The policy ``name`` with its options (wrapped in :class:`Guarded` unless ``guard=False``)."""
    cls, model = policy_class(name)
    if model is not None:
        own = {k: v for k, v in options.items() if k != "min_compress_numel"}
        try:
            validated = model.model_validate(own).model_dump(mode="json")
        except ValidationError as error:
            raise ValueError(one_line(error, prefix="compression.custom_options.")) from None
        options = {**validated, "min_compress_numel": options.get("min_compress_numel", 1024)}
    policy = cls(options)
    return Guarded(policy) if guard else policy


def _import(name: str, path: str) -> type[Policy]:
    cls = _IMPORTED.get(path)
    if cls is None:
        try:
            obj = import_object(path)
        except ValueError as error:
            raise ValueError(f"compression.policy {name!r}: {error}") from None
        cls = _IMPORTED[path] = _check_class(name, obj)
    return cls


def _check_class(name: str, cls: Any) -> type[Policy]:
    if not (inspect.isclass(cls) and issubclass(cls, Policy)):
        raise ValueError(f"policy {name!r}: {cls!r} is not a subclass of controllers.policies.Policy")
    if inspect.isabstract(cls):
        raise ValueError(f"policy {name!r}: {cls.__name__} does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))}")
    return cls


def _import_path(policy: type[Policy] | str) -> str | None:
    """What the controller imports: the path, or the class's path (None: not importable)."""
    if isinstance(policy, str):
        return policy
    if policy.__module__ == "__main__" or "<locals>" in policy.__qualname__:
        return None
    return f"{policy.__module__}:{policy.__qualname__}"


__all__ = ["POLICIES", "Guarded", "Policy", "make_policy", "policy_class", "register_policy",
           "unregister_policy"]
