"""The messages between workers and the controller: the Plan (controller -> every rank).

A :class:`Plan` says, for every layer, which compressor (and with which parameters) its
gradient uses, or that the whole model falls back to dense all-reduce. Plans are
immutable, versioned, and serialise to JSON; :meth:`Plan.digest` is what ranks compare to
prove they hold the same plan.
"""

from __future__ import annotations

import hashlib
import json
import math
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
class Plan:
    """Which compressor each layer uses; ``dense=True`` overrides everything (fallback).

    Attributes:
        version: increases with every decision the controller publishes.
        default: spec for layers without an entry in ``layers``.
        layers: per-layer overrides, by parameter name.
        dense: fall back to plain all-reduce for every layer.
        reason: why this plan was chosen (shown in logs, metrics and summaries).
    """

    version: int = 0
    default: CompressorSpec = DENSE
    layers: tuple[tuple[str, CompressorSpec], ...] = ()
    dense: bool = False
    reason: str = ""
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

    def spec_for(self, layer: str) -> CompressorSpec:
        if self.dense:
            return DENSE
        return self._by_layer.get(layer, self.default)

    def with_version(self, version: int) -> Plan:
        return replace(self, version=version)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "default": self.default.to_dict(),
            "layers": {name: spec.to_dict() for name, spec in self.layers},
            "dense": self.dense,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        unknown = set(data) - {"version", "default", "layers", "dense", "reason"}
        if unknown:
            raise ValueError(f"plan: unknown key {sorted(unknown)[0]!r}")
        layers = {k: CompressorSpec.from_dict(v) for k, v in dict(data.get("layers", {})).items()}
        return cls(
            version=data.get("version", 0),
            default=CompressorSpec.from_dict(data.get("default", {"name": "none"})),
            layers=tuple(sorted(layers.items())),
            dense=bool(data.get("dense", False)),
            reason=str(data.get("reason", "")),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def digest(self) -> int:
        """63-bit fingerprint of the plan's content and version (equal on agreeing ranks)."""
        raw = hashlib.blake2b(self.to_json().encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little") & ((1 << 63) - 1)


# --- worker -> controller -------------------------------------------------------------
_STATS_FLOATS = (
    "loss", "step_seconds", "compute_seconds", "comm_seconds", "samples_per_second",
    "wire_bytes", "dense_bytes",
)
_LAYER_FLOATS = ("grad_norm", "compression_error", "residual_norm", "wire_bytes", "dense_bytes")
MAX_LAYERS = 10_000
MAX_EVENTS = 100


@dataclass(frozen=True)
class GradStats:
    """What one rank reports every ``controller.interval_steps`` steps (fire-and-forget).

    Timing and loss are means over the interval; byte counts are the rank's running totals.
    ``layers`` holds :class:`~raycomp.stats.LayerStats` dicts of the latest statistics step.
    """

    run_id: str
    rank: int
    step: int
    epoch: int
    plan_version: int
    loss: float
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    samples_per_second: float
    wire_bytes: float
    dense_bytes: float
    fallback_active: bool = False
    layers: tuple[dict[str, Any], ...] = ()
    events: tuple[dict[str, Any], ...] = ()
    eval_metric: float | None = None  # accuracy, or loss for the LM; at epoch ends
    outages: int = 0  # times this rank could not reach the controller so far

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["layers"] = [dict(layer) for layer in self.layers]
        out["events"] = [dict(e) for e in self.events]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> GradStats:
        """Strict parsing of an untrusted report: raises ValueError saying what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"stats: expected a mapping, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"stats: unknown field {sorted(unknown)[0]!r}")
        if not isinstance(data.get("run_id"), str) or not data["run_id"]:
            raise ValueError("stats.run_id: expected a non-empty string")
        for key in ("rank", "step", "epoch", "plan_version", "outages"):
            value = data.get(key, 0 if key == "outages" else None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"stats.{key}: expected an integer >= 0, got {value!r}")
        for key in _STATS_FLOATS:
            _finite(f"stats.{key}", data.get(key))
        if data.get("eval_metric") is not None:
            _finite("stats.eval_metric", data["eval_metric"])
        layers = data.get("layers", ())
        if not isinstance(layers, (list, tuple)) or len(layers) > MAX_LAYERS:
            raise ValueError(f"stats.layers: expected a list of at most {MAX_LAYERS} layers")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Mapping) or not isinstance(layer.get("layer"), str):
                raise ValueError(f"stats.layers[{i}]: expected a mapping with a 'layer' name")
            for key in _LAYER_FLOATS:
                _finite(f"stats.layers[{i}].{key}", layer.get(key))
            profile = layer.get("topk_errors", {})
            if not isinstance(profile, Mapping) or len(profile) > 64:
                raise ValueError(f"stats.layers[{i}].topk_errors: expected a mapping of at most 64 ratios")
            for ratio, error in profile.items():
                if not isinstance(ratio, str):
                    raise ValueError(f"stats.layers[{i}].topk_errors: keys must be strings, got {ratio!r}")
                _finite(f"stats.layers[{i}].topk_errors[{ratio!r}]", error)
        events = data.get("events", ())
        if not isinstance(events, (list, tuple)) or len(events) > MAX_EVENTS:
            raise ValueError(f"stats.events: expected a list of at most {MAX_EVENTS} events")
        return cls(**{**data, "layers": tuple(layers), "events": tuple(events)})


def _finite(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
