"""What pyproject.toml claims and what the docs say agree.

* The torch and Ray versions docs/testing.md lists as tested ("Tested versions", measured by
  scripts/check-versions.sh) are the ones README's Install section names, pyproject's ranges
  admit every one of them, and its floors are the oldest tested: a range claims nothing that
  was not run.
* Every install line a user copies (README, the examples' docstrings, docs, messages of the
  package) names extras that pyproject declares, and installs from a checkout or the wheel
  of pyproject's version.
"""

from __future__ import annotations

import re
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.repo import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
README = (REPO / "README.md").read_text(encoding="utf-8")
TESTING = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")

_VERSION = r"\d+(?:\.\d+)+"  # a local part (+cpu, +cu128) is the build, not the version


def requirements(pyproject: dict) -> dict[str, Requirement]:
    """pyproject's runtime dependencies by name."""
    return {(r := Requirement(text)).name: r for text in pyproject["project"]["dependencies"]}


def section(text: str, heading: str) -> str:
    """The body of the Markdown section ``heading`` (up to the next heading of its level or above)."""
    level = heading.split(" ", 1)[0]
    assert f"\n{heading}\n" in f"\n{text}", f"no section {heading!r}"
    body = f"\n{text}".split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def pairs_in_testing_md(text: str) -> set[tuple[str, str]]:
    """(torch, Ray) of each row of docs/testing.md's "Tested versions" table."""
    rows = [line for line in section(text, "## Tested versions").splitlines() if line.startswith("|")]
    assert rows[0].replace(" ", "").lower().startswith("|torch|ray|"), rows[0]
    pairs = set()
    for row in rows[2:]:  # after the header and its rule
        cells = [c.strip() for c in row.strip("|").split("|")]
        torch, ray = (re.match(_VERSION, c) for c in cells[:2])
        assert torch and ray, f"docs/testing.md: a tested row without two versions: {row}"
        pairs.add((torch[0], ray[0]))
    return pairs


def pairs_in_readme(text: str) -> set[tuple[str, str]]:
    """The ``torch X + Ray Y`` pairs README's Install section says are tested."""
    install = section(text, "## Install")
    return set(re.findall(rf"torch\s+({_VERSION})\s+\+\s+Ray\s+({_VERSION})", install))


def disagreements(pyproject: dict, readme: str, testing: str) -> list[str]:
    """Everything in which the three files disagree, in words (empty: they agree)."""
    problems = []
    doc, said = pairs_in_testing_md(testing), pairs_in_readme(readme)
    if not doc:
        problems.append("docs/testing.md lists no tested pair")
    if doc != said:
        problems.append(f"README names {sorted(said)}, docs/testing.md lists {sorted(doc)}")
    reqs = requirements(pyproject)
    for name, index in (("torch", 0), ("ray", 1)):
        spec = reqs[name].specifier
        for pair in sorted(doc):
            if not spec.contains(Version(pair[index]), prereleases=True):
                problems.append(f"pyproject's {name}{spec} leaves out tested {pair[index]}")
        floors = [Version(s.version) for s in spec if s.operator == ">="]
        oldest = min((Version(p[index]) for p in doc), default=None)
        if len(floors) != 1 or oldest is None or floors[0] != Version(oldest.base_version):
            problems.append(f"pyproject's {name} floor ({spec}) is not the oldest tested ({oldest})")
    torch_floor = str(reqs["torch"].specifier)
    ray_floor = str(reqs["ray"].specifier)
    install = section(readme, "## Install")
    for words in (f"`torch{torch_floor}`", f"`ray[default,train,tune]{ray_floor}`"):
        if words not in install:
            problems.append(f"README's Install section does not say {words}")
    return problems


def test_pyproject_readme_and_the_tested_versions_agree():
    assert disagreements(PYPROJECT, README, TESTING) == []


def test_the_newest_tested_torch_is_admitted_with_no_cap_below_it():
    newest = max(Version(torch) for torch, _ in pairs_in_testing_md(TESTING))
    spec = requirements(PYPROJECT)["torch"].specifier
    assert spec.contains(newest) and not any(s.operator in ("<", "<=", "==", "~=") for s in spec), spec


def test_the_project_venvs_cpu_torch_is_admitted():
    """scripts/setup.sh installs ``.[dev]`` over the CPU torch it has: the range must keep it,
    or pip would replace it with PyPI's multi-GB CUDA build."""
    assert requirements(PYPROJECT)["torch"].specifier.contains(Version("2.13.0+cpu"))


def _mutated(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def test_a_disagreement_is_found():
    """Each way of drifting apart is caught (the check has teeth)."""
    assert disagreements(PYPROJECT, README, TESTING) == []
    newest_torch = max((p for p in pairs_in_testing_md(TESTING)), key=lambda p: Version(p[0]))[0]
    # README names a pair docs/testing.md does not list
    readme = _mutated(README, f"torch {newest_torch} +", "torch 9.9.9 +")
    assert any("README names" in p for p in disagreements(PYPROJECT, readme, TESTING))
    # a cap below the newest tested torch
    capped = {**PYPROJECT, "project": {**PYPROJECT["project"], "dependencies": [
        f"{d},<{newest_torch}" if d.startswith("torch") else d for d in PYPROJECT["project"]["dependencies"]]}}
    assert any("leaves out tested" in p for p in disagreements(capped, README, TESTING))
    # a floor older than anything tested
    older = {**PYPROJECT, "project": {**PYPROJECT["project"], "dependencies": [
        re.sub(r">=[\d.]+", ">=2.0", d) if d.startswith("torch") else d
        for d in PYPROJECT["project"]["dependencies"]]}}
    assert any("floor" in p for p in disagreements(older, README, TESTING))
    # a tested row dropped from docs/testing.md
    rows = [line for line in section(TESTING, "## Tested versions").splitlines() if line.startswith("|")]
    assert any("README names" in p for p in disagreements(PYPROJECT, README, TESTING.replace(rows[-1] + "\n", "")))


# --- install lines ----------------------------------------------------------------------------

def _install_texts() -> dict[str, str]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.py")),
             *sorted((REPO / "raycomp").rglob("*.py"))]
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in paths}


def test_every_extra_an_install_line_names_is_declared():
    declared = set(PYPROJECT["project"]["optional-dependencies"])
    for name, text in _install_texts().items():
        for extra in re.findall(r"raycomp(?:-[\w.]+\.whl)?\[([\w,-]+)\]", text):
            assert set(extra.split(",")) <= declared, f"{name}: raycomp[{extra}] is no extra of pyproject's"


def test_the_examples_install_as_the_readme_does():
    """From a checkout (``./raycomp``) or the wheel of pyproject's version, never a bare
    ``raycomp`` that a package index does not hold."""
    version = PYPROJECT["project"]["version"]
    install = section(README, "## Install")
    lines = re.findall(r"^\s*(pip install .*)$", install, re.M)
    for name in ("lightning_ray_train.py", "transformers_ray_train.py"):
        doc = (REPO / "examples" / name).read_text(encoding="utf-8").split('"""')[1]
        lines += re.findall(r"^\s*(pip install .*)$", doc, re.M)
    assert lines
    for line in lines:
        target = line.split("#")[0].split()[2].strip("\"'")
        assert target.startswith("./raycomp") or target.startswith(f"dist/raycomp-{version}-py3-none-any.whl"), line
        assert "raycomp-" not in line or f"raycomp-{version}-py3-none-any.whl" in line, line
    # and README shows how that wheel is built
    assert re.search(r"pip wheel \S*raycomp --no-deps -w dist/", install)
