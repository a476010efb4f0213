"""What the repository itself must never hold: a switched-off Ray token auth, or a secret."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.repo import REPO

DISABLES_AUTH = re.compile(r"""RAY_AUTH_MODE["']?\s*[:=]\s*["']?disabled""")
SECRET = re.compile(r"""(?i)(token|secret|password|passwd|api[_-]?key)["']?\s*[:=]\s*["'][A-Za-z0-9+/_\-]{20,}["']""")


def tracked_texts() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    texts = {}
    for name in names.splitlines():
        path = REPO / name
        if path.is_file() and path.stat().st_size < 2_000_000:
            try:
                texts[name] = path.read_text()
            except UnicodeDecodeError:
                continue  # binary (PNG)
    return texts


def test_the_patterns_have_teeth():
    assert DISABLES_AUTH.search('export RAY_AUTH_MODE=disabled') and DISABLES_AUTH.search('"RAY_AUTH_MODE": "disabled"')
    assert SECRET.search('api_key = "' + "A" * 32 + '"') and SECRET.search("token: '" + "x1" * 12 + "'")
    assert not SECRET.search('"RAY_AUTH_MODE": "token"')


def test_no_tracked_file_disables_token_auth_or_holds_a_secret():
    texts = tracked_texts()
    assert len(texts) > 50  # the scan saw the repository
    this_file = str(Path(__file__).relative_to(REPO))
    offenders = [name for name, text in texts.items()
                 if name != this_file and (DISABLES_AUTH.search(text) or SECRET.search(text))]
    assert not offenders, offenders


def test_the_cluster_token_of_this_machine_is_not_in_the_repository():
    token_file = Path.home() / ".ray" / "auth_token"
    if not token_file.exists():
        pytest.skip("no Ray cluster was ever started here: no token to leak")
    token = token_file.read_text().strip()
    assert len(token) >= 16
    assert not [name for name, text in tracked_texts().items() if token in text]
