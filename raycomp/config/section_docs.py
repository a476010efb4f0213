"""Each section as the reference documents it, read from the typed configuration itself.

One source each, so the reference cannot drift from the code:

* a field's type, constraints and default come from its model (pydantic);
* a field's meaning is the block of ``#:`` comments right above it in its class (the
  comments Sphinx's autodoc reads as an attribute's documentation), read from the class's
  source; a section's is its class docstring;
* :class:`raycomp.train.TrainOptions`, a dataclass of Python arguments, documents its
  fields in its docstring's ``Args:``. Its module is parsed, not imported: importing
  ``raycomp.train`` imports Ray, which printing a reference does not need.

A field without a ``#:`` comment (or an ``Args:`` entry) has an empty meaning, and
``tests/test_configuration_doc.py`` fails on it. :mod:`raycomp.config.reference` writes
these as Markdown and as commented YAML.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from raycomp.config.base import CompressorConfig
from raycomp.config.checkpoint import CheckpointSection
from raycomp.config.compression import CompressionSection
from raycomp.config.controller import ControllerSection
from raycomp.config.policy_options import POLICY_OPTIONS

__all__ = ["EXTRA_SECTIONS", "TOP_SECTIONS", "FieldDoc", "SectionDoc", "field_comments", "inline", "sections",
           "train_options"]

#: the sections a worker reads, by their key in a job config and in ``TrainOptions``
TOP_SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("compression", CompressionSection),
    ("controller", ControllerSection),
    ("checkpoint", CheckpointSection),
)

#: sections that a model holds besides its fields: ``compression.<policy>``, one per built-in policy
EXTRA_SECTIONS: dict[type[BaseModel], dict[str, type[BaseModel]]] = {CompressionSection: POLICY_OPTIONS}

_REQUIRED = object()  # the default of a field that has none


@dataclass(frozen=True)
class FieldDoc:
    """One field: its name, its type in words, its default (JSON; ``_REQUIRED`` if none),
    its meaning, and whether it is a section of its own (documented as one)."""

    name: str
    type: str
    default: Any
    doc: str
    section: bool = False

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclass(frozen=True)
class SectionDoc:
    """A section at its dotted ``key`` (``compression.guard``; ``[]`` marks a list's items)."""

    key: str
    model: type
    doc: str
    fields: tuple[FieldDoc, ...]


# --- where the meanings are -------------------------------------------------------------------


@functools.cache
def _own_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comment block right above each annotated attribute of ``cls`` itself."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # built at run time (pydantic's create_model): no source
        return {}
    lines = source.splitlines()
    node = ast.parse(source).body[0]
    found: dict[str, str] = {}
    for stmt in getattr(node, "body", []):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            block: list[str] = []
            index = stmt.lineno - 2  # the line above (lineno is 1-based)
            while index >= 0 and lines[index].strip().startswith("#:"):
                block.insert(0, lines[index].strip()[2:].strip())
                index -= 1
            found[stmt.target.id] = " ".join(block)
    return found


def field_comments(model: type) -> dict[str, str]:
    """Each field's ``#:`` comment, from the class in ``model``'s MRO that declares it."""
    found: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if "__annotations__" in vars(cls):
            found.update({k: v for k, v in _own_comments(cls).items() if v})
    return found


def _args(doc: str) -> dict[str, str]:
    """The entries of a Google-style ``Args:`` section, each joined into one line."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    if "Args:" not in lines:
        return out
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if line and not line.startswith(" "):
            break
        entry = re.match(r"^ {4}(\w+): ?(.*)$", line)
        if entry:
            name = entry[1]
            out[name] = entry[2].strip()
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def _summary(doc: str) -> str:
    """A docstring without its ``Args:`` section."""
    return doc.split("\nArgs:")[0].strip()


# --- types, constraints, defaults -------------------------------------------------------------


def _bounds(metadata: list[Any]) -> str:
    """The constraints in ``metadata`` in words: ``in [1, 100000]``, ``> 0``, ``matching ^x$``."""
    low = high = None
    words = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            inner = _bounds(list(item.metadata))
            words += [inner] if inner else []
            continue
        for attr, side, sign in (("ge", "low", "["), ("gt", "low", "("), ("le", "high", "]"), ("lt", "high", ")")):
            value = getattr(item, attr, None)
            if value is not None:
                if side == "low":
                    low = (sign, value)
                else:
                    high = (sign, value)
        if getattr(item, "pattern", None):
            words.append(f"matching {item.pattern}")
    if low and high:
        words.insert(0, f"in {low[0]}{low[1]}, {high[1]}{high[0]}")
    elif low:
        words.insert(0, f"{'>=' if low[0] == '[' else '>'} {low[1]}")
    elif high:
        words.insert(0, f"{'<=' if high[0] == ']' else '<'} {high[1]}")
    return ", ".join(words)


def _type(tp: Any) -> str:
    """A type annotation in words: ``int in [1, 100000] or "auto"``, ``list of float``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        bounds = _bounds(list(args[1:]))
        return f"{_type(args[0])} {bounds}".strip()
    if origin is typing.Literal:
        names = [inline(a) for a in args]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    if tp is typing.Any:
        return "any"
    if isinstance(tp, type) and issubclass(tp, CompressorConfig):
        return "compressor ({name: <registry name>, <its parameters>})"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _section_model(tp: Any) -> type[BaseModel] | None:
    """The model of a field that is a section of its own (not a compressor)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel) and not issubclass(tp, CompressorConfig):
        return tp
    return None


def inline(value: Any) -> str:
    """``value`` as one line of YAML: ``auto``, ``'off'``, ``null``, ``[1, 2]``, ``{name: topk}``."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1_000_000).strip()
    return text.removesuffix("\n...").strip()


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    try:
        return model().model_dump(mode="json")
    except Exception:  # noqa: BLE001 - a model with required fields (a list's item) has no default instance
        return {}


# --- the sections -----------------------------------------------------------------------------


def _walk(key: str, model: type[BaseModel], defaults: dict[str, Any]) -> list[SectionDoc]:
    comments = field_comments(model)
    fields: list[FieldDoc] = []
    children: list[SectionDoc] = []
    for name, info in model.model_fields.items():
        child = _section_model(info.annotation)
        item = _section_model(typing.get_args(info.annotation)[0]) \
            if typing.get_origin(info.annotation) is list else None
        bounds = _bounds(list(info.metadata))
        kind = _type(info.annotation) + (f", {bounds}" if bounds else "")
        default = defaults.get(name, _REQUIRED)
        fields.append(FieldDoc(name, kind, default, comments.get(name, ""), section=child is not None))
        if child is not None:
            children += _walk(f"{key}.{name}", child, default if isinstance(default, dict) else {})
        elif item is not None:
            children += _walk(f"{key}.{name}[]", item, {})
    for name, extra in EXTRA_SECTIONS.get(model, {}).items():
        children += _walk(f"{key}.{name}", extra, defaults.get(name) or _defaults(extra))
    doc = inspect.cleandoc(model.__doc__ or "") if "__doc__" in vars(model) else ""
    return [SectionDoc(key, model, doc, tuple(fields)), *children]


def sections(top: tuple[tuple[str, type[BaseModel]], ...] = TOP_SECTIONS) -> list[SectionDoc]:
    """Every section reachable from ``top``, each before the sections it holds."""
    return [s for key, model in top for s in _walk(key, model, _defaults(model))]


def train_options() -> SectionDoc:
    """:class:`raycomp.train.TrainOptions`' fields, read from its module's source."""
    path = Path(__file__).resolve().parent.parent / "_internal" / "train" / "options.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainOptions")
    doc = ast.get_docstring(node) or ""
    meanings = _args(doc)
    fields = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            value = stmt.value
            if isinstance(value, ast.Call) and value.keywords and value.keywords[0].arg == "default_factory":
                default = f"{ast.unparse(value.keywords[0].value)}()"
            else:
                default = ast.unparse(value) if value is not None else _REQUIRED
            fields.append(FieldDoc(stmt.target.id, ast.unparse(stmt.annotation), default,
                                   meanings.get(stmt.target.id, "")))
    return SectionDoc("TrainOptions", object, _summary(doc), tuple(fields))
