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
from collections.abc import Mapping
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
    fragments`` steps apart (:class:`raycomp.local.LocalSteps`)."""

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
    """

    version: int = 0
    default: CompressorSpec = DENSE
    layers: tuple[tuple[str, CompressorSpec], ...] = ()
    dense: bool = False
    reason: str = ""
    local: LocalMode | None = None
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
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        unknown = set(data) - {"version", "default", "layers", "dense", "reason", "local"}
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



__all__ = ["DENSE", "CompressorSpec", "LocalMode", "Plan"]
