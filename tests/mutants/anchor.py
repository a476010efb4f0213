"""Where a mutant's edit lands: a named definition, and a snippet found inside it token by token.

An edit names its anchor by qualified name: a function or method (``ResidualMemory.update``,
``bucket_cap_mb``), a class (``RandomK``), or a module- or class-level assignment
(``RandomK.shared_randomness``). The anchor is looked up by parsing every module under the
search roots, not by path, so moving a definition to another module keeps the edit working.
An anchor written ``path:Name`` searches only under ``path`` (a file or folder, which may lie
outside the roots): for a name defined in several places, or code outside the roots.

Inside the anchor's source the snippet is matched as a sequence of tokens. Whitespace, line
breaks, comments and a trailing comma before a closing bracket do not count, so re-indenting,
re-wrapping or re-commenting the code keeps the edit working; only where the snippet's code
occurs more than once do its comments decide. A snippet that starts with indentation or a line
break replaces whole lines from the start of its first one, a snippet that ends with a line
break replaces through the end of its last one, and the replacement is re-indented by the
difference between the snippet's indentation and the site's. Anything else is ``Stale``: the
anchor is gone, or the snippet is not in it exactly once.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SEARCH_ROOTS", "Edit", "Index", "Site", "Stale", "apply_sites", "locate"]

SEARCH_ROOTS = ("raycomp", "controllers", "jobs")

_TOKEN = re.compile(
    r"""(?P<space>\s+)
      | (?P<comment>\#[^\n]*)
      | (?P<code>[rRbBuUfF]{0,2}(?:'''[\s\S]*?'''|\"\"\"[\s\S]*?\"\"\"|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*")
                 | \w+ | \S)""",
    re.VERBOSE,
)
_CLOSERS = (")", "]", "}")


class Stale(Exception):
    """The edit cannot be placed: its anchor is gone, or its snippet is not in it exactly once."""


@dataclass(frozen=True)
class Edit:
    anchor: str  # qualified name, optionally "path:" + qualified name
    original: str  # the code to find inside the anchor
    replacement: str  # what replaces it


@dataclass(frozen=True)
class Site:
    file: str  # relative to the root the index was built on
    line: int  # where the snippet starts, 1-based
    start: int  # character span in the file's text that the replacement takes
    end: int
    replacement: str  # re-indented to the site


@dataclass(frozen=True)
class _Token:
    text: str
    start: int
    end: int
    comment: bool


def _tokens(text: str, offset: int = 0) -> list[_Token]:
    """Code and comment tokens of ``text`` (spans shifted by ``offset``), trailing commas dropped."""
    out: list[_Token] = []
    last_code = -1  # index in ``out`` of the last code token
    for m in _TOKEN.finditer(text):
        if m.lastgroup == "space":
            continue
        comment = m.lastgroup == "comment"
        word = " ".join(m.group().split()) if comment else m.group()
        if not comment:
            if word in _CLOSERS and last_code >= 0 and out[last_code].text == ",":
                del out[last_code]
            last_code = len(out)
        out.append(_Token(word, m.start() + offset, m.end() + offset, comment))
    return out


def _definitions(body: list[ast.stmt], prefix: str, in_function: bool) -> Iterator[tuple[str, ast.AST]]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            yield name, node
            yield from _definitions(node.body, name + ".", isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not in_function:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    yield prefix + target.id, node
        else:  # definitions under an if, a try, a with
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _definitions(getattr(node, field, []), prefix, in_function)


class Index:
    """Every definition in the Python files under ``root``'s search roots, by qualified name."""

    def __init__(self, root: Path, roots: tuple[str, ...] = SEARCH_ROOTS):
        self.root = root
        self.roots = roots
        self.texts: dict[str, str] = {}
        self._trees: dict[str, ast.Module | None] = {}
        self._names: dict[str, list[tuple[str, int, int]]] = {}
        for top in roots:
            for path in sorted((root / top).rglob("*.py")):
                self._add(path.relative_to(root).as_posix())

    def _add(self, rel: str) -> None:
        if rel in self._trees:
            return
        text = (self.root / rel).read_text()
        self.texts[rel] = text
        try:
            tree = ast.parse(text)
        except SyntaxError:
            self._trees[rel] = None
            return
        self._trees[rel] = tree
        for name, node in _definitions(tree.body, "", False):
            first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            self._names.setdefault(name, []).append((rel, first, node.end_lineno or node.lineno))

    def regions(self, anchor: str) -> list[tuple[str, int, int]]:
        """(file, first line, last line) of each definition the anchor names."""
        where, _, name = anchor.rpartition(":")
        if where:
            path = self.root / where
            for p in [path] if path.is_file() else sorted(path.rglob("*.py")):
                self._add(p.relative_to(self.root).as_posix())
        found = self._names.get(name, [])
        return [r for r in found if not where or r[0] == where or r[0].startswith(where.rstrip("/") + "/")]

    def unparsable(self) -> list[str]:
        return [rel for rel, tree in self._trees.items() if tree is None]


def _line_start(text: str, at: int) -> int:
    return text.rfind("\n", 0, at) + 1


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _shift(text: str, delta: int) -> str:
    if delta == 0:
        return text
    lines = text.splitlines(keepends=True)
    if delta > 0:
        return "".join(" " * delta + ln if ln.strip() else ln for ln in lines)
    return "".join(ln[min(-delta, _indent(ln)):] for ln in lines)


def _find(snippet: list[_Token], tokens: list[_Token]) -> list[int]:
    """Where the snippet's token texts start in ``tokens``."""
    words = [t.text for t in snippet]
    texts = [t.text for t in tokens]
    n = len(words)
    return [i for i in range(len(texts) - n + 1) if texts[i] == words[0] and texts[i:i + n] == words]


def locate(edit: Edit, index: Index) -> Site:
    """Where ``edit`` lands in the files ``index`` holds; ``Stale`` (one line) if it cannot."""
    regions = index.regions(edit.anchor)
    if not regions:
        roots = edit.anchor.rpartition(":")[0] or ", ".join(f"{r}/" for r in index.roots)
        broken = index.unparsable()
        note = f" (unparsable: {', '.join(broken)})" if broken else ""
        raise Stale(f"anchor {edit.anchor} is not defined under {roots}{note}")
    snippet = _tokens(edit.original)
    code = [t for t in snippet if not t.comment]
    if not code:
        raise Stale(f"anchor {edit.anchor}: the snippet holds no code")
    comma = len(code) > 1 and code[-1].text == ","  # a closing bracket may follow it in the code
    if comma:
        snippet.remove(code.pop())
    hits: list[tuple[str, list[_Token], int]] = []
    with_comments: list[tuple[str, list[_Token], int]] = []
    for rel, first, last in regions:
        text = index.texts[rel]
        starts = [0, *(m.end() for m in re.finditer("\n", text)), len(text)]  # ast counts lines by \n
        begin, stop = starts[first - 1], starts[min(last, len(starts) - 1)]
        tokens = _tokens(text[begin:stop], begin)
        plain = [t for t in tokens if not t.comment]
        hits += [(rel, plain[i:i + len(code)], i) for i in _find(code, plain)]
        with_comments += [(rel, tokens[i:i + len(snippet)], i) for i in _find(snippet, tokens)]
    where = ", ".join(sorted({f"{rel}:{first}" for rel, first, _ in regions}))
    head = edit.original.strip().splitlines()[0]
    if len(hits) > 1 and len(code) < len(snippet) and len(with_comments) == 1:
        hits = with_comments  # the comments tell the occurrences apart
    if len(hits) != 1:
        raise Stale(f"anchor {edit.anchor} ({where}): snippet {head!r} found {len(hits)} times (expected once)")
    rel, matched, _ = hits[0]
    text = index.texts[rel]
    start, end = matched[0].start, matched[-1].end
    line_start = _line_start(text, start)
    replacement = edit.replacement
    if edit.original[:1].isspace():  # whole lines from the first one's start, re-indented
        if text[line_start:start].strip():
            raise Stale(f"anchor {edit.anchor} ({rel}): snippet {head!r} starts inside a line")
        own = next(ln for ln in edit.original.splitlines() if ln.strip())
        replacement = _shift(replacement, (start - line_start) - _indent(own))
        start = line_start
    if comma and (after := re.match(r"\s*,", text[end:])):
        end += after.end()
    if edit.original.endswith("\n"):  # through the end of the last line
        stop = text.find("\n", end)
        stop = len(text) if stop < 0 else stop + 1
        rest = text[end:stop].strip()
        if rest and not rest.startswith("#"):
            raise Stale(f"anchor {edit.anchor} ({rel}): snippet {head!r} ends inside a line")
        end = stop
    return Site(rel, text.count("\n", 0, start) + 1, start, end, replacement)


def apply_sites(sites: list[Site], texts: dict[str, str]) -> dict[str, str]:
    """The files' new texts with every site replaced (sites of one file must not overlap)."""
    out: dict[str, str] = {}
    for rel in sorted({s.file for s in sites}):
        text = texts[rel]
        ordered = sorted((s for s in sites if s.file == rel), key=lambda s: s.start, reverse=True)
        for later, site in zip([None, *ordered], ordered, strict=False):
            if later is not None and site.end > later.start:
                raise Stale(f"{rel}: two edits overlap at line {later.line}")
            text = text[:site.start] + site.replacement + text[site.end:]
        out[rel] = text
    return out
