"""The worker -> controller message: :class:`GradStats`, strictly parsed (the controller
never trusts a report: wrong types, non-finite numbers and oversized reports are rejected)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GradStats", "is_finite", "MAX_EVENTS", "MAX_EVENT_BYTES", "MAX_LAYERS", "MAX_NAME_CHARS", "MAX_PROFILE",
    "ReportTooLarge"
]

_STATS_FLOATS = (
    "loss", "step_seconds", "compute_seconds", "comm_seconds", "samples_per_second",
    "wire_bytes", "dense_bytes",
)
_OPTIONAL_FLOATS = ("intra_bytes",)  # absent: 0
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
    ``layers`` holds :class:`~raycomp._internal.reduce.stats.LayerStats` dicts of the latest statistics step.
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
    skipped_steps: int = 0  # steps this rank's optimizer skipped so far (guard or loss-scale overflow)
    loss_scale: float | None = None  # the GradScaler's scale at the boundary (fp16; None without one)
    outer_steps: int = 0  # outer steps (syncs of local steps) this rank applied so far
    lr: float | None = None  # the optimizer's learning rate at the boundary (its largest group's)
    #: bytes this rank sent inside its node so far (two levels, raycomp._internal.reduce.two_level; 0 when flat):
    #: ``wire_bytes`` then counts what crossed nodes
    intra_bytes: float = 0.0

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
        for key in ("rank", "step", "epoch", "plan_version", "outages", "skipped_steps", "outer_steps"):
            value = data.get(key, 0 if key in ("outages", "skipped_steps", "outer_steps") else None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"stats.{key}: expected an integer >= 0, got {value!r}")
        for key in _STATS_FLOATS:
            _finite(f"stats.{key}", data.get(key))
        for key in _OPTIONAL_FLOATS:
            _finite(f"stats.{key}", data.get(key, 0.0))
            if data.get(key, 0.0) < 0:
                raise ValueError(f"stats.{key}: expected a number >= 0, got {data[key]!r}")
        if data.get("eval_metric") is not None:
            _finite("stats.eval_metric", data["eval_metric"])
        if data.get("lr") is not None:
            _finite("stats.lr", data["lr"])
            if data["lr"] < 0:
                raise ValueError(f"stats.lr: expected a number >= 0, got {data['lr']!r}")
        if data.get("loss_scale") is not None:
            _finite("stats.loss_scale", data["loss_scale"])
            if data["loss_scale"] <= 0:
                raise ValueError(f"stats.loss_scale: expected a positive number, got {data['loss_scale']!r}")
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


def is_finite(value: Any) -> bool:
    """Whether an untrusted value is a finite int or float (a bool is not)."""
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
    if not is_finite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
