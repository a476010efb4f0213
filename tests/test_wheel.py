"""The built wheel, as a user installs it: into a fresh virtual environment, used from a
directory outside the repository.

The wheel is built from a copy of this checkout's files (git's tracked and not-ignored ones,
so no stale ``build/`` folder can slip into it) with ``pip wheel --no-deps
--no-build-isolation``, and installed with ``--no-index --no-deps`` into a new venv; nothing is downloaded at run time,
so the new environment sees the dependencies (torch, Ray, ...) of the environment running
the tests through a path entry (``deps.pth``); ``--ignore-installed`` keeps pip from taking the
checkout's editable install of the same version, seen through it, for the wheel. A path entry adds that folder to
``sys.path`` without running its ``.pth`` files, so the checkout's editable install there
stays invisible: ``raycomp`` can only come from the wheel, as the quick-start test asserts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

def _build(root: Path) -> Path:
    """Build the wheel from a copy of the checkout into ``root``; its path."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = root / "src"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(root / "dist"), str(tree)], check=True, timeout=300, cwd=root)
    (wheel,) = (root / "dist").glob("raycomp-*.whl")
    return wheel


def _sources() -> set[str]:
    """The modules a wheel must hold, as paths inside it: raycomp/ as it is, and controllers/
    where the checkout's link raycomp/controllers points (rglob does not follow the link)."""
    assert (REPO / "raycomp" / "controllers").resolve() == REPO / "controllers"
    paths = {str(p.relative_to(REPO)) for p in (REPO / "raycomp").rglob("*.py") if "__pycache__" not in p.parts}
    paths |= {"raycomp/" + str(p.relative_to(REPO)) for p in (REPO / "controllers").rglob("*.py")
              if "__pycache__" not in p.parts}
    return paths


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; its python."""
    root = tmp_path_factory.mktemp("venv")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", "--ignore-installed",
                    "--no-deps", str(wheel)], check=True, timeout=300, cwd=root)
    return python


def _env() -> dict[str, str]:
    # a Ray of its own, as on a user's machine: without RAY_ADDRESS=local ray.init() joins
    # any cluster already running on this machine (another test's), and num_cpus is refused there
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "RAY_ADDRESS": "local"}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def test_the_wheel_holds_every_module_and_only_raycomp(wheel):
    import raycomp

    assert wheel.name.startswith(f"raycomp-{raycomp.__version__}-"), (wheel.name, raycomp.__version__)
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"raycomp"}, top
    missing = _sources() - set(names)
    assert not missing, f"modules not in the wheel (list their packages in pyproject.toml): {sorted(missing)}"
    controller = zipfile.ZipFile(wheel).read("raycomp/controllers/__init__.py").decode()
    assert controller == (REPO / "controllers" / "__init__.py").read_text()
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "raycomp = raycomp.cli:main" in entry


def test_the_quick_start_runs_outside_the_repository_and_raycomp_inspect_reads_it(installed, tmp_path):
    """README's quick start (examples/quickstart.py, copied out of the repository) with the
    wheel: two workers, the controller from its callback, the run's files under the storage
    path, and the wheel's ``raycomp inspect`` reading them."""
    where = subprocess.run([installed, "-c", "import raycomp; print(raycomp.__file__)"], capture_output=True,
                           text=True, check=True, cwd=tmp_path, env=_env()).stdout.strip()
    assert Path(where).is_relative_to(installed.parent.parent), where
    script = tmp_path / "quickstart.py"
    shutil.copy(REPO / "examples" / "quickstart.py", script)
    storage = tmp_path / "storage"
    out = subprocess.run([installed, str(script), "--epochs", "2", "--steps-per-epoch", "25", "--storage",
                          str(storage), "--name", "quick"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((storage / "quick" / "summary.json").read_text())
    assert summary["steps"] == 50 and summary["policy"]["name"] == "adaptive"
    assert summary["policy"]["reports"] > 0  # the workers' statistics reached the controller
    inspect = subprocess.run([installed.parent / "raycomp", "inspect", str(storage / "quick")], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path, env=_env())
    assert inspect.returncode == 0, inspect.stderr
    assert "50 steps, 2 ranks, policy adaptive" in inspect.stdout, inspect.stdout
    assert "(equal to summary.json's totals)" in inspect.stdout, inspect.stdout


def test_the_console_command_runs_from_the_wheel(installed, tmp_path):
    command = installed.parent / "raycomp"
    out = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stderr
    for sub in ("inspect", "plot", "dashboard", "config"):
        assert sub in out.stdout
