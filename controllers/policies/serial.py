"""One serialiser for every policy's state: a typed dataclass to JSON and back.

A policy keeps everything it learns in one dataclass (its *state*); the controller's
snapshots hold it as ``{"schema": SCHEMA, "type": <class name>, "fields": {...}}``. Fields
are read back by their type annotations, so adding a field to a state is one line with a
default: a snapshot written before the field existed loads with the default. Supported
field types: ``int``, ``float``, ``str``, ``bool``, ``None``, unions with ``None``,
``list[T]``, ``tuple[T, ...]``, ``set[T]`` (saved sorted), ``dict[str, T]``, nested
dataclasses and :class:`~raycomp.plan.Plan`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from raycomp.plan import Plan

#: bumped when a saved state cannot be read by the rules above (a field changes meaning)
SCHEMA = 1

T = TypeVar("T")


def dump(state: Any) -> dict[str, Any]:
    """``state`` (a dataclass instance) as a versioned JSON-able mapping."""
    if not dataclasses.is_dataclass(state) or isinstance(state, type):
        raise TypeError(f"policy state: expected a dataclass instance, got {type(state).__name__}")
    return {"schema": SCHEMA, "type": type(state).__name__, "fields": _encode(state)}


def load(cls: type[T], saved: Any) -> T:
    """The ``cls`` instance :func:`dump` saved (ValueError: one line saying what is wrong)."""
    if not isinstance(saved, dict) or set(saved) != {"schema", "type", "fields"}:
        raise ValueError(f"policy state: expected {{schema, type, fields}}, got {_short(saved)}")
    if saved["schema"] != SCHEMA:
        raise ValueError(f"policy state: schema {saved['schema']!r} is not the supported {SCHEMA}")
    if saved["type"] != cls.__name__:
        raise ValueError(f"policy state: saved for {saved['type']!r}, loading into {cls.__name__!r}")
    return _decode(cls, saved["fields"], cls.__name__)


def _encode(value: Any) -> Any:
    if isinstance(value, Plan):  # a dataclass with its own JSON form
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(_encode(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"policy state: cannot save a {type(value).__name__}")


def _decode(tp: Any, data: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _decode(option, data, where)
            except (TypeError, ValueError) as error:
                errors.append(str(error))
        raise ValueError(errors[0] if errors else f"{where}: got {_short(data)}")
    if tp is Plan:
        return Plan.from_dict(data)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping, got {_short(data)}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}; {tp.__name__} has {sorted(fields)}")
        required = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        if required:
            raise ValueError(f"{where}: missing fields {required}; they have no default")
        values = {name: _decode(hints[name], data[name], f"{where}.{name}") for name in fields if name in data}
        return tp(**values)
    if origin in (list, tuple, set, frozenset):
        if not isinstance(data, list):
            raise ValueError(f"{where}: expected a list, got {_short(data)}")
        inner = args[0] if args else Any
        items = [_decode(inner, v, f"{where}[{i}]") for i, v in enumerate(data)]
        return items if origin is list else origin(items)
    if origin is dict:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping, got {_short(data)}")
        value_type = args[1] if args else Any
        return {str(k): _decode(value_type, v, f"{where}.{k}") for k, v in data.items()}
    if tp is float and isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if tp in (int, str, bool) and type(data) is tp:
        return data
    if tp is type(None) and data is None:
        return None
    raise ValueError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {_short(data)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["SCHEMA", "dump", "load"]
