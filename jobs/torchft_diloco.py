"""torchft's DiLoCo as a benchmark baseline (``benchmark.baseline=torchft_diloco``).

torchft (PyPI ``torchft``) runs DiLoCo as its authors ship it: a ``Manager`` per replica
group, a lighthouse that forms the quorum, and ``DiLoCo(manager, [model], inner_optimizer,
outer_optimizer, sync_every=H)`` entered as a context manager around the ordinary loop. It
hooks the inner optimizer: after every H-th ``optimizer.step()`` the ranks all-reduce the
pseudo-gradient (global - local weights, fp32) on torchft's own gloo group and the outer
optimizer (Nesterov SGD, DiLoCo's lr 0.7 and momentum 0.9 unless ``benchmark.diloco_outer_*``
say otherwise) steps the global weights. No DDP: nothing crosses the link in between but the
Manager's heartbeats to the lighthouse.

Here each Ray Train worker is one replica group of one rank. Rank 0 starts the lighthouse in
its process and sends its address to the others over the run's process group; every
address torchft advertises is the worker's node IP (its defaults use the host name, which
does not reach across the benchmark's network namespaces). ``init_sync=False``: the ranks
start from rank 0's weights, broadcast over the run's process group, so no replica needs
torchft's HTTP checkpoint transfer at the start.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from jobs.baseline_guard import BaselineGuardState
from jobs.config import BenchmarkSection
from raycomp._internal.train.ddp_strategy import compression_state
from raycomp.train.gradient_strategy import GradientStrategy, StrategySetup

__all__ = ["DilocoReplica", "TorchftDilocoStrategy", "torchft_diloco"]


class DilocoReplica:
    """One rank's torchft: the lighthouse (rank 0), the replica group's store, the Manager and
    the entered ``DiLoCo`` context. :meth:`close` leaves it and shuts everything down.

    Args:
        model: the rank's model (not DDP-wrapped); rank 0's weights are broadcast first.
        optimizer: the inner optimizer (DiLoCo hooks its ``step``).
        benchmark: ``diloco_sync_every`` and the outer optimizer's settings.
        host: the address this rank's torchft servers advertise (its node IP).
        rank, world_size: this rank in ``group``.
        group: the run's process group, for the lighthouse address and the initial weights.
        timeout_s: torchft's connect, quorum and collective timeouts.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, benchmark: BenchmarkSection,
                 host: str, rank: int, world_size: int, group: Any = None, timeout_s: float = 120.0) -> None:
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        logging.getLogger("torchft").setLevel(logging.WARNING)  # a line per sync otherwise
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world_size) if rank == 0 else None
        address = [f"http://{host}:{self.lighthouse.address().rsplit(':', 1)[1]}" if self.lighthouse else None]
        if world_size > 1:
            dist.broadcast_object_list(address, src=0, group=group)
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0, group=group)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world_size, use_async_quorum=False,
            load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                           optimizer.load_state_dict(state["optimizer"])),
            state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            replica_id=str(rank), store_addr=host, store_port=self.store.port, rank=0, world_size=1,
            lighthouse_addr=address[0], hostname=host, init_sync=False,
            connect_timeout=timeout, quorum_timeout=timeout, timeout=timeout)
        outer = torch.optim.SGD(model.parameters(), lr=benchmark.diloco_outer_lr,
                                momentum=benchmark.diloco_outer_momentum,
                                nesterov=benchmark.diloco_outer_momentum > 0)
        self.diloco = DiLoCo(self.manager, [model], optimizer, outer, sync_every=benchmark.diloco_sync_every,
                             backup_device=torch.device("cpu"), pin_memory=False)
        self.diloco.__enter__()

    def syncs(self) -> int:
        """Syncs committed so far (the Manager's step)."""
        return self.manager.current_step()

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


class _DilocoState(BaselineGuardState):
    """The guard's agreed state; closing it also closes torchft (the loop closes its state)."""

    def __init__(self, inner: Any, rank: int, world_size: int, group: Any, replica: DilocoReplica | None) -> None:
        super().__init__(inner, rank, world_size, group)
        self.replica = replica

    def close(self) -> None:
        if self.replica is not None:
            self.replica.close()
        super().close()


class TorchftDilocoStrategy(GradientStrategy):
    """The bare model; DiLoCo works from the inner optimizer's hooks, so neither backward
    nor the loop's after-step call has anything to do."""

    sharded = False
    bucket_cap_mb = None
    per_step = True  # the loop's guard runs every step (its inputs agreed by BaselineGuardState)

    def __init__(self, model: torch.nn.Module, state: _DilocoState) -> None:
        self.model, self.state = model, state

    def layers(self) -> dict[str, list[int]]:
        return {name: list(p.shape) for name, p in self.model.named_parameters() if p.requires_grad}

    def end_backward(self) -> None:
        pass

    def after_optimizer_step(self, applied: bool, loss: float) -> None:
        return None

    def agreement(self) -> tuple[float, ...]:
        return ()


def torchft_diloco(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup,
                   benchmark: BenchmarkSection) -> TorchftDilocoStrategy:
    """torchft's DiLoCo over ``model`` on this Ray Train worker (one worker: plain training)."""
    import ray.util

    model = model.to(setup.device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    replica = None
    if world > 1:
        replica = DilocoReplica(model, optimizer, benchmark, ray.util.get_node_ip_address(), rank, world,
                                setup.control_group)
    state = _DilocoState(compression_state(model, setup), rank, world, setup.control_group, replica)
    return TorchftDilocoStrategy(model, state)
