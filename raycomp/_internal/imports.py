"""Objects named by import path, ``package.module:Qualname``: how a user's compressor,
policy or workload reaches every process (driver, controller, Ray workers) by name."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(path: str) -> Any:
    """The object ``path`` names; ``ValueError`` with one line if it cannot be had
    (``cannot import 'pkg' (why)`` or ``module 'pkg' has no 'Name'``)."""
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure while importing is a bad path
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"cannot import {module_name!r} ({message})") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no {qualname!r}")
        obj = getattr(obj, part)
    return obj
