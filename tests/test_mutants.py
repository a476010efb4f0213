"""The mutation check's matcher: an edit follows its code through moves, re-indenting and
re-wrapping, and reports STALE (one line naming the anchor) when the code is gone or ambiguous.
No pytest run of any mutant here: these are the placement rules on small trees."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from tests.mutants.anchor import Edit, Index, Stale, apply_sites, locate
from tests.mutants.catalog import MUTANTS
from tests.mutants.mutant import mutant
from tests.mutants.runner import apply, place

MEMORY = '''\
"""Residuals."""


class ResidualMemory:
    def __init__(self):
        self.residuals = {}

    def update(self, name, compensated, sent):
        # what was not sent is kept for the next step
        self.residuals[name] = residual_of(compensated, sent, scale=1.0)

    def reset(self):
        self.residuals.clear()
'''

# the same class after a behaviour-neutral refactor: another package and module, one level
# deeper (inside a with block), the call re-wrapped one argument a line with a trailing comma, comments changed
MOVED = '''\
"""Error feedback, moved."""

import contextlib


with contextlib.suppress(ImportError):
    class ResidualMemory:
        def reset(self):
            self.residuals.clear()

        def update(self, name, compensated, sent):
            if name:  # a comment that was not there before
                self.residuals[name] = residual_of(
                    compensated,
                    sent,
                    scale=1.0,
                )
'''

EDIT = Edit(
    "ResidualMemory.update",
    "        self.residuals[name] = residual_of(compensated, sent, scale=1.0)\n",
    "        self.residuals.pop(name, None)\n        return None\n",
)


def tree(root: Path, files: dict[str, str]) -> Index:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return Index(root)


def applied(edit: Edit, index: Index) -> tuple[str, str]:
    site = locate(edit, index)
    (rel, text), = apply_sites([site], index.texts).items()
    ast.parse(text)  # still Python
    return rel, text


def test_an_edit_lands_in_its_method(tmp_path):
    rel, text = applied(EDIT, tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY}))
    assert rel == "raycomp/_internal/reduce/memory.py"
    assert text == MEMORY.replace(
        "        self.residuals[name] = residual_of(compensated, sent, scale=1.0)\n",
        "        self.residuals.pop(name, None)\n        return None\n")


def test_an_edit_follows_its_method_to_another_module_reindented_and_rewrapped(tmp_path):
    index = tree(tmp_path, {"controllers/efb/residuals.py": MOVED, "raycomp/other.py": "X = 1\n"})
    site = locate(EDIT, index)
    assert (site.file, site.line) == ("controllers/efb/residuals.py", 13)
    rel, text = applied(EDIT, index)
    assert rel == "controllers/efb/residuals.py"
    # the four re-wrapped lines are replaced whole; the replacement is four columns deeper,
    # as the site is, and its two lines keep their relative indentation
    assert text.endswith(
        "            if name:  # a comment that was not there before\n"
        "                self.residuals.pop(name, None)\n"
        "                return None\n")


def test_a_replacement_keeps_its_relative_indentation_at_a_shallower_site(tmp_path):
    edit = Edit("ResidualMemory.update", "            self.residuals[name] = residual_of(compensated, sent, scale=1.0)\n",
                "            if name:\n                    pass\n")
    _, text = applied(edit, tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY}))
    assert "\n        if name:\n                pass\n\n    def reset" in text


def test_an_inline_snippet_is_replaced_in_place(tmp_path):
    edit = Edit("ResidualMemory.update", "compensated, sent, scale=1.0", "sent, compensated, scale=1.0")
    _, text = applied(edit, tree(tmp_path, {"jobs/memory.py": MEMORY}))
    assert "        self.residuals[name] = residual_of(sent, compensated, scale=1.0)\n" in text


def test_stale_when_the_snippet_is_not_in_the_anchor(tmp_path):
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY})
    # the code exists in the module, but not in the method the edit names
    with pytest.raises(Stale, match=r"anchor ResidualMemory.reset \(raycomp/_internal/reduce/memory.py:12\): "
                                    r"snippet 'self.residuals\[name\] = .*' found 0 times \(expected once\)"):
        locate(Edit("ResidualMemory.reset", EDIT.original, EDIT.replacement), index)


def test_stale_when_the_snippet_occurs_twice_in_the_anchor(tmp_path):
    twice = MEMORY.replace("        self.residuals.clear()\n",
                           "        self.residuals.clear()\n        self.residuals.clear()\n")
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": twice})
    with pytest.raises(Stale, match=r"snippet 'self.residuals.clear\(\)' found 2 times \(expected once\)"):
        locate(Edit("ResidualMemory.reset", "        self.residuals.clear()\n", "        pass\n"), index)


def test_stale_when_the_anchor_is_gone(tmp_path):
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY.replace("def update", "def store")})
    with pytest.raises(Stale, match=r"^anchor ResidualMemory.update is not defined under raycomp/, controllers/, jobs/$"):
        locate(EDIT, index)


def test_stale_when_a_whole_line_snippet_is_found_only_inside_a_line(tmp_path):
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY})
    with pytest.raises(Stale, match="starts inside a line"):
        locate(Edit("ResidualMemory.update", "    residual_of(compensated, sent, scale=1.0)\n", "    0\n"), index)
    with pytest.raises(Stale, match="ends inside a line"):
        locate(Edit("ResidualMemory.update", "        self.residuals[name] = residual_of(\n", "        x = (\n"), index)


def test_comments_tell_apart_code_that_occurs_twice(tmp_path):
    clock = '''\
    def step(self):
        self.restart()  # the evaluation
        self.work()
        self.restart()  # the report
    '''
    index = tree(tmp_path, {"raycomp/loop.py": clock})
    site = locate(Edit("step", "    self.restart()  # the report\n", ""), index)
    assert site.line == 4
    with pytest.raises(Stale, match="found 2 times"):
        locate(Edit("step", "    self.restart()\n", ""), index)


def test_a_name_defined_twice_needs_the_snippet_once_across_both_or_a_path(tmp_path):
    files = {"jobs/a.py": "PARAMS = {\n    'int4': {'chunk_size': 2048},\n}\n",
             "jobs/b.py": "PARAMS = {\n    'topk': {'ratio': 0.01},\n}\n",
             "tests/gpu/c.py": "PARAMS = {\n    'int4': {'chunk_size': 2048},\n}\n"}
    index = tree(tmp_path, files)
    assert locate(Edit("PARAMS", "    'int4': {'chunk_size': 2048},\n", ""), index).file == "jobs/a.py"
    # a path prefix searches where the search roots do not reach
    assert locate(Edit("tests/gpu:PARAMS", "    'int4': {'chunk_size': 2048},\n", ""), index).file == "tests/gpu/c.py"


def test_a_mutant_with_edits_in_two_methods_is_applied_to_a_copy(tmp_path):
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY})
    m = mutant("two-edits", "ResidualMemory.update", "sent, scale=1.0", "sent, scale=2.0",
               "tests/test_memory.py", "an example", ("ResidualMemory.reset", "self.residuals.clear()", "pass"))
    sites, problems = place(m, index)
    assert problems == [] and [s.line for s in sites] == [10, 13]
    apply(m, tmp_path)
    text = (tmp_path / "raycomp/_internal/reduce/memory.py").read_text()
    assert "self.residuals[name] = residual_of(compensated, sent, scale=2.0)\n" in text and "        pass\n" in text


def test_overlapping_edits_are_stale(tmp_path):
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY})
    m = mutant("overlap", "ResidualMemory.update", "residual_of(compensated, sent, scale=1.0)", "0",
               "tests/test_memory.py", "an example", ("ResidualMemory.update", "scale=1.0", "scale=2.0"))
    assert any("overlap" in p for p in place(m, index)[1])


def test_the_catalog_is_well_formed():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    for m in MUTANTS:
        assert m.tests and m.why and m.edits, m.name
        for edit in m.edits:
            assert edit.anchor and edit.original.strip() and edit.original != edit.replacement, m.name


def test_a_mutant_reports_which_of_its_edits_is_stale(tmp_path):
    index = tree(tmp_path, {"raycomp/_internal/reduce/memory.py": MEMORY})
    m = mutant("one-stale", "ResidualMemory.store", "sent", "0", "tests/test_memory.py", "an example",
               ("ResidualMemory.reset", "self.residuals.clear()", "pass"))
    sites, problems = place(m, index)
    assert sites[0] is None and sites[1] is not None and sites[1].line == 13
    assert problems == ["anchor ResidualMemory.store is not defined under raycomp/, controllers/, jobs/"]
