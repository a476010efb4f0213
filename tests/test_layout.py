"""The repository's layout rules (issue 83): ``jobs/`` reaches into raycomp's internals only
through the modules docs/architecture.md lists ("Internals jobs/ uses"), and no module is
longer than :data:`MAX_LINES` lines; ``raycomp.controllers`` resolves on the file system and the
internals never import the public packages built on them."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INTERNAL = "raycomp._internal"
SECTION = "## Internals jobs/ uses"
MAX_LINES = 350
#: the folders whose modules are held to MAX_LINES (raycomp/controllers links to controllers/)
SIZED = ("raycomp", "controllers", "jobs")


def allowed_internals(text: str) -> set[str]:
    """The modules the doc's section lists: the first cell of each row of its table."""
    start = text.index(SECTION) + len(SECTION)
    after = re.search(r"^#{1,2} ", text[start:], re.MULTILINE)
    section = text[start:start + after.start()] if after else text[start:]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {m.group(1) for line in rows if (m := re.match(r"\| `([\w.]+)` \|", line))}


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def internal_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every import of a ``raycomp._internal`` module in ``source``, and every
    attribute chain that reaches one without importing it (``raycomp._internal.x.y``)."""
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # a.b of a.b.c
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith(INTERNAL)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(INTERNAL):
            if node.module == INTERNAL:  # from raycomp._internal import topology
                found += [(node.lineno, f"{INTERNAL}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node)
            if name and name.startswith(INTERNAL + "."):
                found.append((node.lineno, name))
    return found


def _covered(name: str, allowed: set[str]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in allowed)


def _modules(*folders: str) -> list[Path]:
    """The ``.py`` files under ``folders`` (symbolic links to folders not followed)."""
    out = []
    for folder in folders:
        for root, dirs, files in os.walk(REPO / folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            out += [Path(root) / f for f in sorted(files) if f.endswith(".py")]
    return out


def test_the_section_is_read_as_the_listed_modules():
    text = f"intro\n\n{SECTION}\n\nwords\n\n| module | why |\n|---|---|\n| `{INTERNAL}.a.b` | x |\n" \
           f"| `{INTERNAL}.c` | y `{INTERNAL}.d` |\n\n## Next\n\n| `{INTERNAL}.e` | z |\n"
    assert allowed_internals(text) == {f"{INTERNAL}.a.b", f"{INTERNAL}.c"}


def test_every_way_of_reaching_an_internal_module_is_found():
    source = (f"import {INTERNAL}.a\nfrom {INTERNAL}.b import x\nfrom {INTERNAL} import c\n"
              f"from raycomp import d\nimport raycomp\nraycomp._internal.e.f.g\n")
    found = [name for _, name in internal_uses(source)]
    assert found[:3] == [f"{INTERNAL}.a", f"{INTERNAL}.b", f"{INTERNAL}.c"]
    assert _covered(found[3], {f"{INTERNAL}.e.f"}) and not _covered(found[3], {f"{INTERNAL}.e.ff"})


def test_jobs_use_only_the_internals_the_architecture_doc_lists():
    allowed = allowed_internals((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert allowed, f"docs/architecture.md: no modules listed under {SECTION!r}"
    used, unlisted = set(), []
    for path in _modules("jobs"):
        for line, name in internal_uses(path.read_text(encoding="utf-8")):
            used.add(name)
            if not _covered(name, allowed):
                unlisted.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not unlisted, (f"jobs/ uses raycomp internals that docs/architecture.md ({SECTION!r}) does not list; "
                          "use the public API, or list the module and why: " + "; ".join(unlisted))
    missing = sorted(m for m in allowed if not (REPO / (m.replace(".", "/") + ".py")).is_file()
                     and not (REPO / m.replace(".", "/") / "__init__.py").is_file())
    assert not missing, f"docs/architecture.md ({SECTION!r}) lists modules that do not exist: {missing}"
    stale = sorted(m for m in allowed if not any(_covered(name, {m}) for name in used))
    assert not stale, f"docs/architecture.md ({SECTION!r}) lists modules jobs/ no longer uses: {stale}"


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(REPO)): n for p in _modules(*SIZED)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by what they hold): {long}"


def _imported_modules(path: Path) -> list[tuple[int, str, int]]:
    """(line, module, level) of every ``import``/``from ... import`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", node.level))
    return found


def test_controllers_is_one_package_in_the_checkout():
    """``raycomp/controllers`` is a link to the top-level folder (no ``__path__`` rewrite), and
    the folder imports its own modules relatively, so file-system tools resolve both."""
    link = REPO / "raycomp" / "controllers"
    assert link.is_symlink() and link.resolve() == REPO / "controllers", link
    absolute = [f"{p.relative_to(REPO)}:{line}: {module}" for p in _modules("controllers")
                for line, module, level in _imported_modules(p)
                if level == 0 and (module == "raycomp.controllers" or module.startswith("raycomp.controllers."))]
    assert not absolute, "controllers/ imports its own modules relatively (from .state import ...): " + "; ".join(absolute)


def test_internals_never_import_the_public_packages_built_on_them():
    """``raycomp/_internal`` imports no public package that is built on it (``raycomp.train``,
    ``raycomp.integrations``): their ``__init__`` imports the internals, so such an import
    runs a package half-way and fails when an internal module is imported first."""
    public = ("raycomp.train", "raycomp.integrations")
    found = [f"{p.relative_to(REPO)}:{line}: {module}" for p in _modules("raycomp/_internal")
             for line, module, level in _imported_modules(p)
             if level == 0 and any(module == m or module.startswith(m + ".") for m in public)]
    assert not found, "import the definition from raycomp._internal instead: " + "; ".join(found)
