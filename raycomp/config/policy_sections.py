"""The policy part of ``compression``: which policy, and its typed options.

Each built-in policy has a section of its own, ``compression.<policy>`` (e.g.
``compression.adaptive``), always present and validated whichever policy runs; its model
is in :data:`raycomp.config.policy_options.POLICY_OPTIONS`. Any other policy takes its
options from ``compression.custom_options``, validated by its class's ``options_model``
when the validation is given the class: a name registered with
``raycomp.controllers.policies.register_policy``, or the import path of one. The policies
themselves live with the controller, so the job config never imports it: whoever validates
hands it the registry of policies as the validation's context,
``CompressionSection.model_validate(data, context=policy_context(REGISTRY))`` (as
``jobs.config.validate`` and ``raycomp.train.TrainOptions`` do). Validated without one, a
section knows the built-in policies and import paths only.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model

from raycomp._internal.registry import ANY_PATH, IMPORT_PATH
from raycomp.config.base import Strict, one_line
from raycomp.config.policy_options import POLICY_OPTIONS

if TYPE_CHECKING:
    from raycomp._internal.registry import Registry

#: the key of a validation context that holds the registry of policies
POLICIES = "policies"


def policy_context(registry: Registry[Any]) -> dict[str, Any]:
    """The validation context that hands ``compression`` the registry of policies
    (``raycomp.controllers.policies.REGISTRY``): a name registered there becomes its class's
    import path, and its ``custom_options`` are validated by the class's options model."""
    return {POLICIES: registry}


def registry_of(info: ValidationInfo) -> Registry[Any] | None:
    """The registry of policies a validation was given (:func:`policy_context`), if any."""
    return info.context.get(POLICIES) if isinstance(info.context, dict) else None


@functools.cache
def sections_model() -> type[BaseModel]:
    """A strict model with one field per built-in policy section, each defaulted."""
    fields: dict[str, Any] = {n: (m, Field(default_factory=m)) for n, m in POLICY_OPTIONS.items()}
    return create_model("PolicySections", __base__=Strict, **fields)


def split_sections(data: dict[str, Any], own_fields: set[str]) -> dict[str, Any]:
    """``data`` with every key that is not one of ``own_fields`` validated as a policy
    section (unknown keys refused: ``<key>: unknown key``), each section present."""
    own = {k: v for k, v in data.items() if k in own_fields}
    sections = sections_model().model_validate({k: v for k, v in data.items() if k not in own_fields})
    return {**own, **{name: getattr(sections, name) for name in POLICY_OPTIONS}}


def check_policy_name(name: str, registry: Registry[Any] | None) -> str:
    """The name the controller gets: a built-in name, the import path of a name registered in
    ``registry`` (so the controller's process imports it), or an import path as given."""
    if name in POLICY_OPTIONS:
        return name
    if registry is not None and name in registry.registered():
        return registry.import_path(name) or name
    if IMPORT_PATH.match(name):
        return name
    builtin = ", ".join(repr(p) for p in POLICY_OPTIONS)
    if registry is None:
        raise ValueError(f"must be one of {builtin} or {ANY_PATH} (a name registered with "
                         "raycomp.controllers.policies.register_policy needs the registry: validate with "
                         f"context=raycomp.config.policy_context(REGISTRY)), got {name!r}")
    raise ValueError(f"must be one of {builtin}, a name registered with raycomp.controllers.policies.register_policy, "
                     f"or {ANY_PATH}, got {name!r}")


def custom_model(policy: str, registry: Registry[Any] | None) -> type[BaseModel] | None:
    """The options model of a policy that is not built in, if ``registry`` knows it without
    importing anything (a registered name, or the import path of one)."""
    if registry is None:
        return None
    for name, path in registry.registered().items():
        if policy in (name, path, registry.import_path(name)):
            return registry.get(name).options_model
    return None


def check_custom_options(policy: str, custom_options: dict[str, Any], registry: Registry[Any] | None) -> None:
    """ValueError (one line) if ``custom_options`` do not fit ``policy`` (checked against its
    options model where ``registry`` knows it; the controller checks them in any case)."""
    if policy in POLICY_OPTIONS:
        if custom_options:
            raise ValueError(f"custom_options: only for policies that are not built in; "
                             f"set compression.{policy}.<option> instead")
        return
    model = custom_model(policy, registry)
    if model is not None:
        try:
            model.model_validate(custom_options)
        except ValidationError as error:
            raise ValueError(one_line(error, prefix="custom_options.")) from None


def options_of(section: BaseModel) -> dict[str, Any]:
    """What the controller gets as the options of ``section.policy`` (JSON): a built-in
    policy's section, or ``custom_options`` as given (the controller validates them with the
    policy's options model)."""
    policy = section.policy  # type: ignore[attr-defined]
    if policy in POLICY_OPTIONS:
        chosen = getattr(section, policy, None)
        return chosen.model_dump(mode="json") if chosen is not None else {}
    return dict(section.custom_options)  # type: ignore[attr-defined]


def check_sharded_policy(section: BaseModel) -> None:
    """ValueError (one line) unless ``section.policy`` can steer a sharded (FSDP) run at all;
    a policy that is not built in is the user's to vouch for."""
    policy = section.policy  # type: ignore[attr-defined]
    if policy not in POLICY_OPTIONS:
        return
    reason = getattr(type(getattr(section, policy, None)), "not_shardable", None)
    if reason:
        fits = [n for n, m in POLICY_OPTIONS.items() if m.not_shardable is None]
        raise ValueError(f"compression.policy: {policy!r} {reason}; allowed with scaling.strategy=fsdp: "
                         f"{', '.join(fits)}")


def check_sharded_options(section: BaseModel) -> None:
    """ValueError (one line naming the option) unless every compressor the options of a
    built-in ``section.policy`` may choose fits a reduce-scatter row."""
    policy = section.policy  # type: ignore[attr-defined]
    options = getattr(section, policy, None) if policy in POLICY_OPTIONS else None
    if options is not None and hasattr(options, "check_sharded"):
        options.check_sharded(f"compression.{policy}")


#: the model config of ``compression``: its policy sections arrive as extra keys, each
#: validated by :func:`split_sections`
SECTION_CONFIG = ConfigDict(extra="allow", frozen=True, validate_default=True)

__all__ = ["POLICIES", "SECTION_CONFIG", "check_custom_options", "check_policy_name", "check_sharded_options",
           "check_sharded_policy", "custom_model", "options_of", "policy_context", "registry_of",
           "sections_model", "split_sections"]
