"""The Plan: what the controller sends to every rank (the reverse message, worker ->
controller, is :class:`raycomp.messages.GradStats`).

A :class:`Plan` says, for every layer, which compressor (and with which parameters) its
gradient uses, or that the whole model falls back to dense all-reduce. Plans are
immutable, versioned, and serialise to JSON; :meth:`Plan.digest` is what ranks compare to
prove they hold the same plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from raycomp.compressors import compressor_class, compressor_parameters, make_compressor
from raycomp.compressors.base import Compressor, mix_seed


@dataclass(frozen=True)
class CompressorSpec:
    """A compressor by registry name and parameters; validated when created."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        make_compressor(self.name, **dict(self.params))  # raises ValueError naming the field

    @classmethod
    def of(cls, name: str, **params: Any) -> CompressorSpec:
        return cls(name, tuple(sorted(params.items())))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompressorSpec:
        if not isinstance(data, Mapping) or "name" not in data:
            raise ValueError(f"compressor: expected a mapping with a 'name', got {data!r}")
        params = {k: v for k, v in data.items() if k != "name"}
        return cls.of(data["name"], **params)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.params)}

    @property
    def is_dense(self) -> bool:
        return self.name == "none"

    def build(self, layer: str, rank: int, base_seed: int = 0) -> Compressor:
        """A fresh compressor for ``layer`` on ``rank``.

        Compressors that draw random numbers get a seed derived from the layer name, and
        from the rank unless all ranks must draw the same numbers (Random-K, PowerSGD).
        """
        params = dict(self.params)
        if "seed" in compressor_parameters(self.name) and "seed" not in params:
            cls = compressor_class(self.name)
            owner = "shared" if cls.shared_randomness else rank
            params["seed"] = mix_seed(base_seed, layer, owner)
        return make_compressor(self.name, **params)

    def __str__(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}({args})" if args else self.name


DENSE = CompressorSpec("none")


@dataclass(frozen=True)
class LocalMode:
    """Local steps (the DiLoCo family): ranks run ``sync_every`` inner steps without
    exchanging gradients, then average their pseudo-gradients (global - local weights),
    each layer compressed as the plan's spec for it says, and an outer optimizer steps the
    global weights. ``fragments`` pieces of the model sync in turn, ``sync_every /
    fragments`` steps apart (:class:`raycomp._internal.local.LocalSteps`)."""

    sync_every: int
    fragments: int = 1

    def __post_init__(self) -> None:
        for key, value, low in (("sync_every", self.sync_every, 1), ("fragments", self.fragments, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"plan.local.{key}: expected an integer >= {low}, got {value!r}")
        if self.sync_every % self.fragments:
            raise ValueError(f"plan.local.fragments: must divide sync_every ({self.sync_every}), "
                             f"got {self.fragments}")

    def to_dict(self) -> dict[str, int]:
        return {"sync_every": self.sync_every, "fragments": self.fragments}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LocalMode:
        if not isinstance(data, Mapping) or set(data) - {"sync_every", "fragments"} or "sync_every" not in data:
            raise ValueError(f"plan.local: expected {{sync_every, fragments}}, got {data!r}")
        return cls(data["sync_every"], data.get("fragments", 1))


@dataclass(frozen=True)
class Plan:
    """Which compressor each layer uses; ``dense=True`` overrides everything (fallback).

    Attributes:
        version: increases with every decision the controller publishes.
        default: spec for layers without an entry in ``layers``.
        layers: per-layer overrides, by parameter name.
        dense: fall back to plain all-reduce for every layer (per step, whatever ``local``
            says).
        local: local steps (:class:`LocalMode`): gradients stay on their rank for
            ``local.sync_every`` steps and the layers' specs compress the pseudo-gradients
            instead; None: every step's gradients are reduced.
        reason: why this plan was chosen (shown in logs, metrics and summaries).
        why: the decision's structured reason, as the controller's policy gave it
            (:meth:`raycomp.controllers.policies.decision.Decision.facts`: ``rule``, the rule
            that decided, and the named facts it decided from); empty for a plan built by
            hand. It travels with the plan to every rank, so rank 0's switch line and
            ``plans.jsonl`` say why without asking the controller. Not compared: two plans
            that differ only in it are the same plan (the digest still covers it, and
            every rank installs the same bytes).
    """

    version: int = 0
    default: CompressorSpec = DENSE
    layers: tuple[tuple[str, CompressorSpec], ...] = ()
    dense: bool = False
    reason: str = ""
    local: LocalMode | None = None
    why: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    _by_layer: dict[str, CompressorSpec] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"plan.version: expected an integer >= 0, got {self.version!r}")
        object.__setattr__(self, "_by_layer", dict(self.layers))

    @classmethod
    def uniform(cls, name: str, *, version: int = 0, reason: str = "", **params: Any) -> Plan:
        """Every layer with the same compressor."""
        return cls(version=version, default=CompressorSpec.of(name, **params), reason=reason)

    @classmethod
    def per_layer(
        cls, layers: Mapping[str, CompressorSpec], *, default: CompressorSpec = DENSE,
        version: int = 0, reason: str = "",
    ) -> Plan:
        return cls(version, default, tuple(sorted(layers.items())), reason=reason)

    @property
    def rule(self) -> str:
        """The rule that chose this plan (``why["rule"]``; "" for a plan built by hand)."""
        return str(self.why.get("rule", ""))

    def summary(self, layers: Sequence[str] | None = None) -> str:
        """What this plan does, in a few words: ``dense``, ``topk(ratio=0.01) on 12/14 layers``,
        ``local steps H=8 (2 fragments), int8 on 14/14 layers``. ``layers``: the model's
        layer names, to count the layers on each compressor; without them the default
        compressor and the number of per-layer overrides are named instead. Layers below
        ``min_compress_numel`` travel dense whatever the plan says; this counts what the
        plan says."""
        if self.dense:
            return "dense"
        if layers:
            counts: dict[str, int] = {}
            for name in layers:
                spec = self.spec_for(name)
                if not spec.is_dense:
                    counts[str(spec)] = counts.get(str(spec), 0) + 1
            parts = [f"{label} on {count}/{len(layers)} layers"
                     for label, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
        else:
            overrides = sum(1 for _, spec in self.layers if spec != self.default)
            parts = [] if self.default.is_dense and not overrides else [str(self.default)]
            parts += [f"{overrides} layers overridden"] if overrides else []
        text = "; ".join(parts) or "dense"
        if self.local is not None:
            fragments = f" ({self.local.fragments} fragments)" if self.local.fragments > 1 else ""
            return f"local steps H={self.local.sync_every}{fragments}, {text}"
        return text

    @property
    def trains_as_ddp(self) -> bool:
        """Whether a step under this plan is plain data-parallel training: every layer's
        gradient all-reduced exactly, every step (no compressor, no cast, no local steps)."""
        if self.dense:
            return True
        return self.local is None and self.default.is_dense and all(spec.is_dense for _, spec in self.layers)

    @property
    def local_steps(self) -> LocalMode | None:
        """The local-step mode in force (None per step, and always under ``dense``)."""
        return None if self.dense else self.local

    def spec_for(self, layer: str) -> CompressorSpec:
        if self.dense:
            return DENSE
        return self._by_layer.get(layer, self.default)

    def with_version(self, version: int) -> Plan:
        return replace(self, version=version)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "version": self.version,
            "default": self.default.to_dict(),
            "layers": {name: spec.to_dict() for name, spec in self.layers},
            "dense": self.dense,
            "reason": self.reason,
        }
        if self.local is not None:  # absent per step: a per-step plan's digest is unchanged
            data["local"] = self.local.to_dict()
        if self.why:  # absent for a plan built by hand: its digest is unchanged
            data["why"] = dict(self.why)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        unknown = set(data) - {"version", "default", "layers", "dense", "reason", "local", "why"}
        if unknown:
            raise ValueError(f"plan: unknown key {sorted(unknown)[0]!r}")
        layers = {k: CompressorSpec.from_dict(v) for k, v in dict(data.get("layers", {})).items()}
        return cls(
            version=data.get("version", 0),
            default=CompressorSpec.from_dict(data.get("default", {"name": "none"})),
            layers=tuple(sorted(layers.items())),
            dense=bool(data.get("dense", False)),
            reason=str(data.get("reason", "")),
            local=None if data.get("local") is None else LocalMode.from_dict(data["local"]),
            why=_why(data.get("why")),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def digest(self) -> int:
        """63-bit fingerprint of the plan's content and version (equal on agreeing ranks);
        computed once per plan (it is immutable), as the step log writes it every step."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            raw = hashlib.blake2b(self.to_json().encode(), digest_size=8).digest()
            cached = int.from_bytes(raw, "little") & ((1 << 63) - 1)
            object.__setattr__(self, "_digest", cached)  # frozen: not a field, not compared
        return cached


def _why(data: Any) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping) or not isinstance(data.get("rule", ""), str):
        raise ValueError(f"plan.why: expected a mapping of facts with a string 'rule', got {data!r}")
    return dict(data)


__all__ = ["DENSE", "CompressorSpec", "LocalMode", "Plan"]
