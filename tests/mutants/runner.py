"""Run the mutation check: each mutant's edits in a fresh copy of the repository, then its tests.

For every mutant the repository's files (tracked, plus untracked files git does not ignore,
as they are in the working tree) are copied into a fresh temporary directory, the mutant's
edits are placed (tests/mutants/anchor.py) and applied to the copy, and the mutant's test
selection runs there with ``PYTHONPATH`` pointing at the copy (Ray workers get it too:
``tests/conftest.py`` passes the repository the tests live in). Outcomes:

* ``KILLED``   pytest reported a failure (exit 1), or the selection ran past its time limit
* ``SURVIVED`` the selection passed with the code broken: a test is missing
* ``STALE``    an edit cannot be placed: its anchor (a function, method, class or assignment,
               found by name in any module) is gone, or its snippet is not in the anchor
               exactly once; re-point the entry in tests/mutants/catalog/
* ``ERROR``    anything else (a selected test file is missing, nothing collected, pytest
               usage error, the unmutated selection fails under ``--baseline``)

The exit status is 0 only when every mutant run was KILLED (with ``--list``: when every
mutant can be placed).

A mutant is an honest bug someone could write; its test selection is the smallest set of
the normal suite's tests that should catch it. No test may be written to match a mutant's
text: a mutant that survives means a behavioural test is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .anchor import Index, Site, Stale, apply_sites, locate
from .catalog import MUTANTS
from .mutant import Mutant

__all__ = ["Outcome", "main", "place", "run_mutant"]

REPO = Path(__file__).resolve().parents[2]
STATUSES = ("KILLED", "SURVIVED", "STALE", "ERROR")


def place(m: Mutant, index: Index) -> tuple[list[Site | None], list[str]]:
    """Where each of the mutant's edits lands (None: it cannot), and why any cannot (empty: all can)."""
    sites: list[Site | None] = []
    problems = []
    for edit in m.edits:
        try:
            sites.append(locate(edit, index))
        except Stale as e:
            sites.append(None)
            problems.append(str(e))
    if not problems:
        try:
            apply_sites([s for s in sites if s], index.texts)
        except Stale as e:
            problems.append(str(e))
    return sites, problems


def apply(m: Mutant, root: Path) -> None:
    index = Index(root)
    sites, problems = place(m, index)
    if problems:
        raise Stale("; ".join(problems))
    for rel, text in apply_sites([s for s in sites if s], index.texts).items():
        (root / rel).write_text(text)


def repo_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=repo, check=True, capture_output=True,
    ).stdout.decode()
    # a file, or a link (raycomp/controllers, a link to a folder, which is_file() does not take)
    return [f for f in out.split("\0") if f and ((repo / f).is_file() or (repo / f).is_symlink())]


def copy_repo(repo: Path, files: list[str], dest: Path) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        if (repo / f).is_symlink():  # raycomp/controllers: the copy links to its own controllers/
            target.symlink_to(os.readlink(repo / f))
        else:
            shutil.copy2(repo / f, target)


def missing_test_files(m: Mutant, root: Path) -> list[str]:
    paths = [a.split("::")[0] for i, a in enumerate(m.tests)
             if not a.startswith("-") and (i == 0 or m.tests[i - 1] not in ("-k", "-m"))]
    return [p for p in paths if not (root / p).exists()]


@dataclass
class Outcome:
    mutant: Mutant
    status: str
    seconds: float
    detail: str = ""


def run_selection(tests: tuple[str, ...], root: Path, timeout_s: int, log: Path) -> tuple[int | None, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    env.pop("RAY_ADDRESS", None)
    # "-m not benchmark": a mutant's tests run whatever tier they are in (the default run leaves
    # out the long checks; a selection of its own "-m" comes later and wins)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not benchmark", *tests]
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the whole session: pytest, its gloo children, Ray
            proc.wait()
            rc = None
    tail = log.read_text().strip().splitlines()
    return rc, tail[-1] if tail else ""


def run_mutant(m: Mutant, repo: Path, files: list[str], log_dir: Path, keep: bool,
               baseline: bool, index: Index) -> Outcome:
    started = time.monotonic()
    _, problems = place(m, index)
    if problems:
        return Outcome(m, "STALE", 0.0, "; ".join(problems))
    root = Path(tempfile.mkdtemp(prefix=f"raycomp-mutant-{m.name}-"))
    try:
        copy_repo(repo, files, root)
        missing = missing_test_files(m, root)
        if missing:
            return Outcome(m, "ERROR", time.monotonic() - started,
                           f"test files not in the repository: {', '.join(missing)}")
        if baseline:
            rc, tail = run_selection(m.tests, root, m.timeout_s, log_dir / f"{m.name}.baseline.log")
            if rc != 0:
                return Outcome(m, "ERROR", time.monotonic() - started,
                               f"the selection fails without the mutant (rc {rc}): {tail}")
        try:
            apply(m, root)
        except Stale as e:  # a file git does not copy (ignored) held the anchor
            return Outcome(m, "STALE", time.monotonic() - started, str(e))
        rc, tail = run_selection(m.tests, root, m.timeout_s, log_dir / f"{m.name}.log")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.monotonic() - started
    if rc is None:
        return Outcome(m, "KILLED", seconds, f"timed out after {m.timeout_s} s")
    if rc == 1:
        return Outcome(m, "KILLED", seconds, tail)
    if rc == 0:
        return Outcome(m, "SURVIVED", seconds, tail)
    return Outcome(m, "ERROR", seconds, f"pytest exit status {rc}: {tail}")


def list_mutants(selected: list[Mutant], index: Index) -> int:
    """Per mutant: whether it applies, its tests, each edit's anchor and where it was found, the bug."""
    stale = 0
    for m in selected:
        sites, problems = place(m, index)
        stale += bool(problems)
        print(f"{m.name:<46} {'STALE' if problems else 'applies':<8} {' '.join(m.tests)}")
        for edit, site in zip(m.edits, sites, strict=True):
            print(f"    {edit.anchor:<42} {f'{site.file}:{site.line}' if site else '-'}")
        for problem in problems:
            print(f"    STALE: {problem}")
        print(f"    {m.why}")
    print(f"\n{len(selected) - stale} of {len(selected)} mutants apply; {stale} stale")
    return 1 if stale else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true",
                        help="list the mutants, where each edit's anchor is found, and whether each applies")
    parser.add_argument("--baseline", action="store_true",
                        help="run each selection unmutated first (it must pass)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies")
    parser.add_argument("--log-dir", type=Path, help="where pytest output goes (default: a temp dir)")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        parser.error("duplicate mutant names")
    selected = list(MUTANTS)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown mutant {unknown[0]!r}; known: {', '.join(names)}")
        selected = [m for m in MUTANTS if m.name in args.only]

    index = Index(REPO)
    if args.list:
        return list_mutants(selected, index)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="raycomp-mutants-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    files = repo_files(REPO)
    print(f"{len(selected)} mutants; copies of {len(files)} files; pytest logs in {log_dir}", flush=True)
    outcomes = []
    started = time.monotonic()
    for m in selected:
        outcome = run_mutant(m, REPO, files, log_dir, args.keep, args.baseline, index)
        outcomes.append(outcome)
        print(f"{outcome.status:<9} {outcome.seconds:7.1f} s  {m.name:<46} {' '.join(m.tests)}", flush=True)
        if outcome.status != "KILLED" or outcome.detail.startswith("timed out"):
            print(f"{'':<20}{outcome.detail}", flush=True)
        if outcome.status == "STALE":
            print(f"{'':<20}!!! STALE MUTANT {m.name}: the code it targets is gone or changed; re-point "
                  f"its anchor or snippet in tests/mutants/catalog/ (--list shows where each is found) !!!",
                  flush=True)
    total = time.monotonic() - started
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    print(f"\n{', '.join(f'{n} {s.lower()}' for s, n in counts.items())} in {total:.0f} s")
    return 0 if counts["KILLED"] == len(outcomes) else 1
