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
    # wire bytes of the payloads the bench measured, against the documented wire formats
    # for N = 65,536 worked out by hand (k = ceil(1% of N) = 656)
    documented = {
        "none": 4 * 65536,
        "fp16": 2 * 65536,
        "bf16": 2 * 65536,
        "topk": 656 * (4 + 4),  # fp32 values + int32 indices
        "randomk": 656 * 4,  # values only
        "sign": 65536 // 8 + 4,  # 1 bit each + fp32 scale
        "terngrad": 65536 // 4 + 4,  # 2 bits each + fp32 scale
        "qsgd": 65536 // 2 + 4 * 128,  # 7 points -> 4 bits; one fp32 norm per 512
        "int8": 65536 + 8 * 32,  # 1 byte each + fp32 (min, max) per 2048
        "powersgd": 4 * (1024 + 64) * 4,  # 1024 x 64 view, rank 4: P and Q in fp32
    }
    for name, nbytes in documented.items():
        assert by_name[name]["wire_bytes"] == nbytes, (name, by_name[name]["wire_bytes"])
    # the exact baseline must be charged what the topk payload really weighs
    assert by_name["torch_topk"]["wire_bytes"] == by_name["topk"]["wire_bytes"]
    # data-dependent sizes: dgc_topk keeps [(1 - 0.1) k, k]; threshold 2.576 keeps ~1% of N(0, 1)
    dgc = by_name["dgc_topk"]
    assert dgc["wire_bytes"] == round(dgc["density"] * 65536) * 8
    assert 0.9 * 656 <= dgc["density"] * 65536 <= 656
    threshold = by_name["threshold"]
    assert threshold["wire_bytes"] == round(threshold["density"] * 65536) * 8
    assert 0.008 <= threshold["density"] <= 0.012, threshold["density"]

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
