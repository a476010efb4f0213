"""docs/README.md is the index a newcomer navigates by: every page under docs/ is linked
from it (the benchmark reports through docs/benchmarks/README.md, which the index links, as
it links the benchmark history), every link of it resolves, and README.md links to it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.support.repo import REPO

DOCS = REPO / "docs"
INDEX = DOCS / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page: Path) -> set[Path]:
    """The local files ``page`` links to, resolved."""
    return {(page.parent / target).resolve() for target in LINK.findall(page.read_text(encoding="utf-8"))
            if "://" not in target and not target.startswith("mailto:")}


def _pages() -> set[Path]:
    """Every page the index must link: each file under docs/ but the index itself, and of
    docs/benchmarks/ only its README and history (the reports are the benchmark index's)."""
    pages = set()
    for path in DOCS.rglob("*"):
        if not path.is_file() or path == INDEX:
            continue
        inside = path.relative_to(DOCS).parts
        if inside[0] == "benchmarks" and path.relative_to(DOCS / "benchmarks").as_posix() not in (
                "README.md", "history.md"):
            continue
        pages.add(path.resolve())
    return pages


def test_every_page_under_docs_is_linked_from_the_index():
    missing = sorted(p.relative_to(DOCS.resolve()).as_posix() for p in _pages() - _links(INDEX))
    assert not missing, f"docs/README.md does not link {missing}: add one line for each"


def test_the_index_gives_one_line_to_each_page_and_no_link_is_dead():
    text = INDEX.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if "://" not in target:
            assert (INDEX.parent / target).exists(), f"docs/README.md: dead link {target}"
    for page in _pages():
        name = page.relative_to(DOCS.resolve()).as_posix()
        entry = [line for line in text.splitlines() if line.startswith(f"- [{name}]({name})")]
        assert len(entry) == 1, f"docs/README.md: {name} needs one entry `- [{name}]({name}): ...`"
        assert entry[0].split(")", 1)[1].startswith(": ") and len(entry[0]) > len(name) * 2 + 10, entry


def test_readme_links_the_docs_index():
    assert (DOCS / "README.md").resolve() in _links(REPO / "README.md")


def test_job_configuration_is_reachable_from_where_job_configs_are_discussed():
    page = (DOCS / "job-configuration.md").resolve()
    assert page in _links(INDEX)
    assert page in _links(DOCS / "configuration.md"), "configuration.md's intro names the job config"


def test_a_page_left_out_of_the_index_is_found(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    (docs / "benchmarks").mkdir(parents=True)
    for name in ("usage.md", "new.md", "benchmarks/README.md", "benchmarks/history.md",
                 "benchmarks/e2e-x.md"):
        (docs / name).write_text("# x\n")
    (docs / "README.md").write_text("- [usage.md](usage.md): the ways in.\n"
                                    "- [benchmarks/README.md](benchmarks/README.md): reports.\n"
                                    "- [benchmarks/history.md](benchmarks/history.md): old ones.\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", docs)
    monkeypatch.setattr(sys.modules[__name__], "INDEX", docs / "README.md")
    unlinked = {p.name for p in _pages() - _links(docs / "README.md")}
    assert unlinked == {"new.md"}  # a benchmark report is not the index's to link
