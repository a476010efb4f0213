"""The base of every config model: strict, frozen, one-line errors; compressors by name."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from raycomp.plan import CompressorSpec


class ConfigError(ValueError):
    """A configuration problem; ``str()`` is one line naming the key."""


class Strict(BaseModel):
    """A config model: unknown keys refused, frozen, defaults validated too."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    # where the section sits in ``TrainOptions`` and in a job config (``compression.guard``):
    # the prefix of the dotted key its one-line errors name (a class variable, not a field)
    config_key: ClassVar[str] = ""

    def __init__(self, /, **data: Any) -> None:
        """Built in Python (``CompressionSection(warmup_steps=-1)``): a bad value is a
        one-line :class:`ConfigError` naming its dotted key, not pydantic's report."""
        try:
            super().__init__(**data)
        except ValidationError as error:
            key = type(self).config_key
            raise ConfigError(one_line(error, prefix=f"{key}." if key else "")) from None

    # a section nested in another (a dict, a YAML mapping) is still validated by pydantic
    # itself, so that the outer model's error names the whole dotted key
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]



class CompressorConfig(Strict):
    """A compressor by registry name with its parameters, e.g. ``{name: topk, ratio: 0.01}``."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str

    @model_validator(mode="after")
    def _known(self) -> CompressorConfig:
        self.spec()  # raises ValueError naming the parameter
        return self

    def spec(self) -> CompressorSpec:
        return CompressorSpec.of(self.name, **(self.model_extra or {}))


def compressor(name: str, **params: Any) -> CompressorConfig:
    return CompressorConfig(name=name, **params)


#: a message that starts with the key it is about: ``a.b: ...``, ``a.b ...`` or ``a: ...``
_NAMES_A_KEY = re.compile(r"^[a-z_]+((\.[A-Za-z0-9_\[\]]+)+:? |: )")


def one_line(error: ValidationError, prefix: str = "") -> str:
    """The first problem of a validation error as ``<prefix><dotted key>: <what is wrong>``."""
    first = error.errors()[0]
    key = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        message = f"must be one of {expected}, got {first['input']!r}"
    elif first["type"] == "missing":
        message = "required"
    elif "input" in first and first["type"] not in ("value_error", "assertion_error"):
        message = f"{message} (got {first['input']!r})"
    if not key and _NAMES_A_KEY.match(message):  # a whole-config check that names its own keys
        return f"{prefix}{message}"
    return f"{prefix}{key or 'config'}: {message}"


__all__ = ["CompressorConfig", "ConfigError", "Strict", "compressor", "one_line"]
