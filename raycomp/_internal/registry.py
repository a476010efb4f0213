"""Classes by name: the one registry behind compressors and policies.

A registry answers a name with a class. The name is one of:

* a built-in name, given when the registry is made;
* a name given to :meth:`Registry.register` in this process (a class, or its import path);
* an import path ``"package.module:Class"``, imported on first use by whichever process
  needs the class: the robust way across processes (driver, controller actor, workers),
  since plans and configs carry only names.

Every error is one line naming what was wrong and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from raycomp._internal.imports import import_object

T = TypeVar("T")

#: a name a user may register: letters, digits, '_', '.', '-', at most 64
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
#: ``package.module:Qualname``
IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
ANY_PATH = "an import path 'package.module:Class'"


class Registry(Generic[T]):
    """Built-in classes, this process's registrations, and classes by import path.

    Args:
        kind: what the classes are ("compressor", "policy"), the first word of errors.
        key: the config key a name appears under, which unknown names are reported
            against (``compressor``, ``compression.policy``).
        builtins: the built-in classes, each under its ``name`` class attribute.
        check: returns the class if it is a valid ``kind`` (called as ``check(name, obj)``),
            else raises ValueError with one line.
    """

    def __init__(self, kind: str, key: str, builtins: list[type[T]],
                 check: Callable[[str, Any], type[T]]) -> None:
        self.kind, self.key, self._check = kind, key, check
        self.builtins: dict[str, type[T]] = {}
        for cls in builtins:
            self.builtins[cls.name] = check(cls.name, cls)  # type: ignore[attr-defined]
        self._registered: dict[str, type[T] | str] = {}  # user name -> class or import path
        self._imported: dict[str, type[T]] = {}  # import path -> class, per process

    def register(self, name: str, target: type[T] | str, *, replace: bool = False) -> None:
        """Make ``name`` stand for ``target`` (a class or its import path) in this process.

        Registering the same target again is a no-op; another target under a taken name
        needs ``replace=True``; built-in names cannot be replaced.
        """
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{self.kind} name {name!r}: expected letters, digits, '_', '.' or '-' "
                             "(at most 64, starting with a letter or '_')")
        if name in self.builtins:
            raise ValueError(f"{self.kind} name {name!r} is built in; choose another name")
        if isinstance(target, str):
            if not IMPORT_PATH.match(target):
                raise ValueError(f"{self.kind} {name!r}: {target!r} is not {ANY_PATH}")
        else:
            self._check(name, target)
        current = self._registered.get(name)
        if current is not None and current != target and not replace:
            raise ValueError(f"{self.kind} name {name!r} is already registered to {describe(current)}; "
                             "pass replace=True to change it")
        self._registered[name] = target

    def unregister(self, name: str) -> None:
        """Forget a name given to :meth:`register` (built-in names stay)."""
        if name not in self._registered:
            raise ValueError(f"{self.kind} name {name!r} is not registered; registered: "
                             f"{', '.join(sorted(self._registered)) or '(none)'}")
        del self._registered[name]

    def registered(self) -> dict[str, str]:
        """This process's registrations: name -> ``module:Class``."""
        return {name: describe(target) for name, target in sorted(self._registered.items())}

    def names(self) -> list[str]:
        """Every name this process knows: the built-in ones, then the registered ones."""
        return [*self.builtins, *sorted(self._registered)]

    def allowed(self) -> str:
        """The allowed names, for an error message."""
        return f"{', '.join(self.names())}, or {ANY_PATH}"

    def get(self, name: str) -> type[T]:
        """The class ``name`` stands for; ValueError (one line) if there is none."""
        if name in self.builtins:
            return self.builtins[name]
        target = self._registered.get(name)
        if target is None and isinstance(name, str) and IMPORT_PATH.match(name):
            target = name
        if target is None:
            raise ValueError(f"{self.key}: unknown name {name!r}; allowed: {self.allowed()}")
        return target if not isinstance(target, str) else self._import(name, target)

    def import_path(self, name: str) -> str | None:
        """What another process imports for a registered ``name``: its path, or the class's
        (None: the class is not importable, e.g. defined in ``__main__``)."""
        target = self._registered[name]
        if isinstance(target, str):
            return target
        if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
            return None
        return describe(target)

    def _import(self, name: str, path: str) -> type[T]:
        cls = self._imported.get(path)
        if cls is None:
            try:
                obj = import_object(path)
            except ValueError as error:
                raise ValueError(f"{self.kind} {name!r}: {error}") from None
            cls = self._imported[path] = self._check(name, obj)
        return cls


def describe(target: type | str) -> str:
    """``module:Qualname`` of a class (an import path as it is)."""
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


__all__ = ["ANY_PATH", "IMPORT_PATH", "NAME", "Registry", "describe"]
