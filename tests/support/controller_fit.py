"""A 2-worker Ray Train fit with a controller service of its own, for tests that train a
function of theirs on real Ray."""

from __future__ import annotations

from pathlib import Path

from tests.support.ray_env import RAY_TEST_ENV

__all__ = ["fit_with_controller"]


def fit_with_controller(train_func, tmp_path: Path, prefix: str, max_failures: int = 0,
                        worker_env: dict[str, str] | None = None):
    """Rank 0's return value of a 2-worker Ray Train run of ``train_func``, with a controller
    service of its own (metrics off). ``train_func`` gets ``{"controller": its name,
    "output_dir": tmp_path / "out"}``; ``max_failures`` worker-group restarts are allowed;
    ``worker_env``: environment variables the workers start with (before their process
    group exists, e.g. the wire recorder's ``FLIGHT_RECORDER_ENV``)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raycomp.train
    from raycomp.config import ControllerSection

    name = f"{prefix}-{tmp_path.name}"[:60]
    callback = raycomp.train.ControllerCallback(ControllerSection(name=name, metrics_enabled=False))
    trainer = TorchTrainer(
        train_func, train_loop_config={"controller": name, "output_dir": str(tmp_path / "out")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), callbacks=[callback],
                             failure_config=FailureConfig(max_failures=max_failures),
                             worker_runtime_env={"env_vars": {**RAY_TEST_ENV, **worker_env}} if worker_env else None))
    return trainer.fit().return_value
