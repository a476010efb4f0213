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
_LAYER_KEYS = frozenset(("layer", "compressor", "numel", *_LAYER_FLOATS, "topk_errors"))
MAX_LAYERS = 10_000
MAX_EVENTS = 100
MAX_EVENT_BYTES = 4096  # one guard event is ~100 bytes
MAX_PROFILE = 64  # Top-K ratios in one layer's error profile
MAX_NAME_CHARS = 512  # run id, layer and compressor names


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
        """Strict parsing of an untrusted report: raises ValueError saying what is wrong
        (:class:`ReportTooLarge` when it is over a size bound).

        This runs for every report the controller receives, so each layer is checked with
        one cheap test and only a failing layer is examined again for the message.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"stats: expected a mapping, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"stats: unknown field {sorted(unknown)[0]!r}")
        run_id = data.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("stats.run_id: expected a non-empty string")
        if len(run_id) > MAX_NAME_CHARS:
            raise ReportTooLarge(f"stats.run_id: longer than {MAX_NAME_CHARS} characters")
        for key in ("rank", "step", "epoch", "plan_version", "outages"):
            value = data.get(key, 0 if key == "outages" else None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"stats.{key}: expected an integer >= 0, got {value!r}")
        for key in _STATS_FLOATS:
            _finite(f"stats.{key}", data.get(key))
        if data.get("eval_metric") is not None:
            _finite("stats.eval_metric", data["eval_metric"])
        layers = data.get("layers", ())
        if not isinstance(layers, (list, tuple)):
            raise ValueError("stats.layers: expected a list of layer statistics")
        if len(layers) > MAX_LAYERS:
            raise ReportTooLarge(f"stats.layers: more than {MAX_LAYERS} layers")
        for i, layer in enumerate(layers):
            if not _layer_ok(layer):
                _layer_error(f"stats.layers[{i}]", layer)
        events = data.get("events", ())
        if not isinstance(events, (list, tuple)):
            raise ValueError("stats.events: expected a list of events")
        if len(events) > MAX_EVENTS:
            raise ReportTooLarge(f"stats.events: more than {MAX_EVENTS} events")
        for i, event in enumerate(events):
            if not isinstance(event, Mapping):
                raise ValueError(f"stats.events[{i}]: expected a mapping")
            if _approx_size(event, MAX_EVENT_BYTES) > MAX_EVENT_BYTES:
                raise ReportTooLarge(f"stats.events[{i}]: larger than {MAX_EVENT_BYTES} bytes")
        return cls(**{**data, "layers": tuple(layers), "events": tuple(events)})


class ReportTooLarge(ValueError):
    """A report over one of the size bounds (counted apart from malformed ones)."""


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _layer_ok(layer: Any) -> bool:
    """The fast check of one layer's statistics (see :func:`_layer_error` for what it means)."""
    isfinite = math.isfinite
    try:
        if not _LAYER_KEYS.issuperset(layer):
            return False
        name, compressor, numel = layer["layer"], layer.get("compressor", ""), layer.get("numel", 0)
        if not (type(name) is str and len(name) <= MAX_NAME_CHARS and type(compressor) is str
                and len(compressor) <= MAX_NAME_CHARS and type(numel) is int and numel >= 0):
            return False
        for key in _LAYER_FLOATS:
            value = layer[key]
            if type(value) is bool or not isfinite(value):
                return False
        profile = layer.get("topk_errors", {})
        if not isinstance(profile, Mapping) or len(profile) > MAX_PROFILE:
            return False
        for ratio, error in profile.items():
            if type(ratio) is not str or len(ratio) > 32 or type(error) is bool or not isfinite(error):
                return False
        return True
    except (TypeError, KeyError, OverflowError, AttributeError):  # not a mapping, a missing key, not a number
        return False


def _layer_error(where: str, layer: Any) -> None:
    """Raise the error that says why ``layer`` failed :func:`_layer_ok`."""
    if not isinstance(layer, Mapping) or not isinstance(layer.get("layer"), str):
        raise ValueError(f"{where}: expected a mapping with a 'layer' name")
    unknown = set(layer) - _LAYER_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown field {sorted(map(str, unknown))[0]!r}")
    for key in ("layer", "compressor"):
        value = layer.get(key, "")
        if not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
        if len(value) > MAX_NAME_CHARS:
            raise ReportTooLarge(f"{where}.{key}: longer than {MAX_NAME_CHARS} characters")
    numel = layer.get("numel", 0)
    if type(numel) is not int or numel < 0:
        raise ValueError(f"{where}.numel: expected an integer >= 0, got {numel!r}")
    for key in _LAYER_FLOATS:
        _finite(f"{where}.{key}", layer.get(key))
    profile = layer.get("topk_errors", {})
    if not isinstance(profile, Mapping):
        raise ValueError(f"{where}.topk_errors: expected a mapping of ratio -> error")
    if len(profile) > MAX_PROFILE:
        raise ReportTooLarge(f"{where}.topk_errors: more than {MAX_PROFILE} ratios")
    for ratio, error in profile.items():
        if not isinstance(ratio, str) or len(ratio) > 32:
            raise ValueError(f"{where}.topk_errors: keys must be ratio strings, got {ratio!r}")
        _finite(f"{where}.topk_errors[{ratio!r}]", error)
    raise ValueError(f"{where}: invalid layer statistics")  # unreachable unless the checks drift


def _approx_size(obj: Any, limit: int) -> int:
    """Upper-bounded size estimate of a nested value (stops counting past ``limit``)."""
    total, stack = 0, [obj]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, Mapping):
            total += 8 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 8 * len(item)
            stack.extend(item)
        elif isinstance(item, (str, bytes)):
            total += len(item)
        else:
            total += 8
    return total


def _finite(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
