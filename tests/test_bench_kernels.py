"""Smoke test of ``python -m jobs.bench kernels`` (quick mode, tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from raycomp.compressors import COMPRESSORS

REPO = Path(__file__).resolve().parents[1]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "jobs.bench", "kernels", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_quick_run_writes_one_row_per_compressor(tmp_path: Path) -> None:
    result = run_bench("--quick", "--sizes", "64K", "--repeats", "1", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr

    rows = json.loads((tmp_path / "kernels.json").read_text())
    assert isinstance(rows, list)
    names = [row["compressor"] for row in rows]
    assert sorted(names) == sorted([*COMPRESSORS, "torch_topk"])  # one row each, one size

    by_name = {row["compressor"]: row for row in rows}
    for row in rows:
        assert row["numel"] == 65536
        assert row["dense_bytes"] == 4 * 65536
        assert row["compress_s"] > 0 and row["decompress_s"] > 0, row
        assert row["wire_bytes"] > 0, row
        assert row["threads"] == 1
        assert not row.get("mutated_input"), row
    for name in ("topk", "sign", "int8", "powersgd", "torch_topk"):
        assert by_name[name]["wire_bytes"] < by_name[name]["dense_bytes"], by_name[name]
    assert 0.009 <= by_name["dgc_topk"]["density"] <= 0.0101
    assert by_name["torch_topk"]["wire_bytes"] == 656 * 8  # k = ceil(1% of 64K) = 656

    report = (tmp_path / "kernels.md").read_text()
    assert "python -m jobs.bench kernels --quick" in report
    assert "## Targets" in report and ("PASS" in report or "MISS" in report)
    assert "| torch_topk | 65,536 |" in report


def test_invalid_size_exits_2_with_message(tmp_path: Path) -> None:
    result = run_bench("--sizes", "abc", "--output-dir", str(tmp_path))
    assert result.returncode == 2
    assert "invalid size 'abc'" in result.stderr
    assert "--sizes" in result.stderr
    assert not (tmp_path / "kernels.json").exists()
