"""README stays a user's page: short, a results table a user can read, no dead links."""

from __future__ import annotations

import re

from tests.support.repo import REPO

README = (REPO / "README.md").read_text()


def test_readme_is_under_200_lines_with_at_most_six_result_rows():
    assert len(README.splitlines()) <= 200
    results = README.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in results.splitlines() if line.startswith("|")][2:]  # after header, rule
    assert 1 <= len(rows) <= 6, rows
    assert not any("PASS" in row or "MISS" in row for row in rows), "the scorecard lives in docs/benchmarks"
    for row in rows:
        assert re.search(r"\]\(docs/benchmarks/[\w.-]+\.md\)", row), row


def test_every_relative_link_in_readme_and_the_benchmark_index_resolves():
    pages = [REPO / "README.md", REPO / "docs" / "benchmarks" / "README.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: dead link {target}"


def test_readme_anchors_into_usage_exist():
    usage = (REPO / "docs" / "usage.md").read_text()
    slugs = {re.sub(r"[^\w\- ]", "", heading.strip("# ").lower()).replace(" ", "-")
             for heading in usage.splitlines() if heading.startswith("#")}
    for anchor in re.findall(r"\]\(docs/usage\.md#([^)]+)\)", README):
        assert anchor in slugs, f"README links docs/usage.md#{anchor}, no such heading"
