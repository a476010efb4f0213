"""A run registered with a plain :class:`~raycomp.controllers.service.Controller` and the
reports its ranks send, for tests that feed the controller by hand."""

from __future__ import annotations

from raycomp.controllers.policies import StaticOptions
from raycomp.controllers.service import Controller

__all__ = ["LAYERS", "register", "report"]

#: the run's layers: name -> element count
LAYERS = {"fc1.weight": 32768, "fc2.weight": 5120, "fc1.bias": 512}


def report(run_id: str, rank: int, step: int, loss: float = 1.0, norm: float = 1.0, **extra) -> dict:
    """Rank ``rank``'s report at ``step``: every layer on Top-K, ``extra`` fields added."""
    layers = [{"layer": name, "compressor": "topk", "numel": n, "grad_norm": norm, "compression_error": 0.9,
               "residual_norm": 0.1, "wire_bytes": 100.0, "dense_bytes": 1000.0} for name, n in LAYERS.items()]
    return {"run_id": run_id, "rank": rank, "step": step, "epoch": 0, "plan_version": 0, "loss": loss,
            "step_seconds": 0.1, "compute_seconds": 0.08, "comm_seconds": 0.02, "samples_per_second": 640.0,
            "wire_bytes": 1000.0 * step, "dense_bytes": 10000.0 * step, "layers": layers, **extra}


def register(controller: Controller, run_id: str, policy: str = "static", options=None, warmup: int = 10):
    """Register a 2-rank run of :data:`LAYERS` (K = 5)."""
    options = options or StaticOptions().model_dump(mode="json")
    return controller.register_run(run_id, 2, LAYERS, policy, options, warmup, 5, 1024)
