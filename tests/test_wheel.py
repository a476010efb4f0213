"""The built wheel, as a user installs it: into a fresh virtual environment, used from a
directory outside the repository.

The wheel is built from a copy of this checkout's files (git's tracked and not-ignored ones,
so no stale ``build/`` folder can slip into it) with ``pip wheel --no-deps
--no-build-isolation``, and installed with ``--no-index --no-deps`` into a new venv; nothing is downloaded at run time,
so the new environment sees the dependencies (torch, Ray, ...) of the environment running
the tests through a path entry (``deps.pth``). A path entry adds that folder to
``sys.path`` without running its ``.pth`` files, so the checkout's editable install there
stays invisible: ``raycomp`` can only come from the wheel, as the first test asserts.
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

#: a user's Ray Train script: two workers, the controller started by its callback, a static
#: int8 plan that only the controller can hand the workers (the warm-up is dense)
SCRIPT = """
import json, sys
import ray, torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
import raycomp.train
from raycomp.config import CompressionSection, ControllerSection

NAME = sys.argv[1]

def train_func(config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection.model_validate(
            {"policy": "static", "static": {"compressor": {"name": "int8"}}, "warmup_steps": 4}),
        controller=ControllerSection(name=NAME, interval_steps=2, metrics_enabled=False))
    model = raycomp.train.prepare_model(model, optimizer, options=options)
    loop = raycomp.train.current()
    gen = torch.Generator().manual_seed(ray.train.get_context().get_world_rank())
    for _ in loop.epochs(1, 30):
        for _ in range(30):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            raycomp.train.step(loss, samples=len(y))
    return raycomp.train.finish()

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
callback = raycomp.train.ControllerCallback(ControllerSection(name=NAME, metrics_enabled=False))
result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=NAME, storage_path=sys.argv[2], callbacks=[callback])).fit()
totals = result.return_value
print("RESULT " + json.dumps({"raycomp": raycomp.__file__, "wire": totals["wire_bytes_total"],
                              "dense": totals["dense_bytes_total"], "plan": totals["final_plan"],
                              "switches": totals["plan_switches"]}))
"""


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
    """The modules a wheel must hold, as paths inside it: raycomp/ as it is, except the
    checkout's stand-in for the controller, which the wheel replaces with controllers/."""
    paths = {str(p.relative_to(REPO)) for p in (REPO / "raycomp").rglob("*.py") if "__pycache__" not in p.parts}
    paths.discard("raycomp/controllers/__init__.py")
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
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                    "--no-deps", str(wheel)], check=True, timeout=300, cwd=root)
    return python


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
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


def test_a_ray_train_script_outside_the_repository_trains_with_the_controller(installed, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = subprocess.run([installed, str(script), f"wheel-{os.getpid()}", str(tmp_path / "storage")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert Path(result["raycomp"]).is_relative_to(installed.parent.parent), result["raycomp"]
    # the controller's int8 plan reached both workers: after the dense warm-up the wire
    # carries about a quarter of the dense bytes
    assert result["plan"]["default"]["name"] == "int8", result["plan"]
    assert result["switches"] >= 1
    assert result["wire"] < 0.5 * result["dense"], result


def test_the_console_command_runs_from_the_wheel(installed, tmp_path):
    command = installed.parent / "raycomp"
    out = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stderr
    for sub in ("inspect", "plot", "dashboard", "config"):
        assert sub in out.stdout
