"""The guard's compression error on healthy runs: what ``max_compression_error`` is set against.

For each (compressor, ranks, levels) case, ``W`` real gloo processes on this machine train
the BatchNorm CNN on Fashion-MNIST through raycomp's DDP hook with that compressor from step
0, statistics every step, and record after each step the worst layer's error of the applied
mean against the exact mean of the inputs (:func:`raycomp._internal.reduce.mean_error.layer_errors`, what the
guard judges) beside each rank's own error (what it judged before). The report
(``docs/benchmarks/guard-mean-error.md``) gives their median, 90th percentile and maximum.

    python -m jobs.bench guard-error [--steps 40] [--skip 5] [--only int4,topk]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["CASES", "HELP", "add_arguments", "run"]

HELP = "the guard's compression error (applied mean vs exact mean) on healthy runs, per compressor"

#: (compressor, its parameters, ranks, two levels at 2 nodes)
CASES: list[tuple[str, dict[str, Any], int, bool]] = [
    ("int8", {}, 2, False), ("int4", {}, 2, False), ("int4", {}, 4, False), ("int4", {}, 4, True),
    ("topk", {"ratio": 0.01}, 2, False), ("topk", {"ratio": 0.01}, 4, False), ("topk", {"ratio": 0.01}, 4, True),
    ("powersgd", {"rank": 2}, 2, False), ("powersgd", {"rank": 2}, 4, False), ("sign", {}, 2, False),
    ("qsgd", {}, 2, False), ("qsgd", {}, 3, False), ("terngrad", {}, 2, False),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="steps per case (default 40)")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the figures (default 5)")
    parser.add_argument("--only", default="", help="comma-separated compressor names (default: every case)")


def _rank(rank: int, world: int, store: str, case: tuple, steps: int, skip: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        torch.save(_train(rank, world, case, steps, skip), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, case: tuple, steps: int, skip: int) -> tuple[list[float], list[float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from jobs.data import fashion_mnist
    from jobs.models import bn_cnn
    from raycomp import CompressionState, Plan, compression_hook
    from raycomp._internal.reduce.mean_error import layer_errors
    from raycomp._internal.topology import Topology

    name, params, _, levels = case
    train, _ = fashion_mnist()
    x_all = torch.as_tensor(train.x[:20000]).float()
    x_all = (x_all.unsqueeze(1) if x_all.dim() == 3 else x_all) / (255.0 if x_all.max() > 2 else 1.0)
    y_all = torch.as_tensor(train.y[:20000]).long()
    torch.manual_seed(0)
    model = bn_cnn()
    ddp = DDP(model, bucket_cap_mb=1)
    state = CompressionState(ddp, Plan.uniform(name, **params), min_compress_numel=1024, stats_every=1,
                             topology=Topology.of_rank(rank, 2, world // 2) if levels else None)
    ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    layers = [n for n, p in model.named_parameters() if p.numel() >= 1024]
    gen = torch.Generator().manual_seed(rank)
    applied, own = [], []
    for step in range(steps):
        idx = torch.randint(0, len(y_all), (64,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx]).backward()
        optimizer.step()
        errors = layer_errors(state.mean_samples, layers, state.position)  # every rank: a collective
        if step >= skip:
            applied += [max(errors.values())] if errors else []
            own.append(max(s.compression_error for s in state.stats))
    state.close()
    return applied, own


def _quantiles(values: list[float]) -> str:
    if not values:  # a compressor without error feedback: the guard does not judge it
        return "not judged | | "
    ordered = sorted(values)
    return " | ".join(f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.3f}" for q in (0.5, 0.9)) + \
        f" | {ordered[-1]:.3f}"


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    print("| compressor | ranks | applied mean: median | p90 | max | each rank's own: median | p90 | max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    only = {name for name in args.only.split(",") if name}
    for case in CASES:
        name, params, world, levels = case
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as work:
            out = os.path.join(work, "result")
            mp.start_processes(_rank, args=(world, os.path.join(work, "store"), case, args.steps, args.skip, out),
                               nprocs=world, start_method="spawn")
            applied, own = torch.load(f"{out}.0")
        label = f"{name} {params}" if params else name
        print(f"| {label} | {'2 x ' + str(world // 2) if levels else world} | {_quantiles(applied)} | "
              f"{_quantiles(own)} |", flush=True)
    return 0
