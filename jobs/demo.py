"""A local demo of compressed data-parallel training, without Ray: W gloo processes train
an MLP on sklearn digits with dense all-reduce, Top-K 1% + error feedback and PowerSGD
rank 2, and print accuracy and wire bytes side by side.

    python -m jobs.demo [--world-size 2] [--epochs 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from jobs.data import digits
from jobs.models import accuracy, mlp
from raycomp import CompressionState, Plan, compression_hook

PLANS = {
    "dense": Plan(),
    "topk_1pct_ef": Plan.uniform("topk", ratio=0.01),
    "powersgd_r2": Plan.uniform("powersgd", rank=2),
}


def train_digits(rank: int, world_size: int, plan: dict, epochs: int = 20, seed: int = 0) -> dict:
    """DDP training of the digits MLP with the raycomp hook; returns rank's results."""
    torch.manual_seed(seed)
    train, test = digits(seed=seed)
    shard = train.shard(rank, world_size)
    model = DDP(mlp())
    state = CompressionState(model, Plan.from_dict(plan))
    model.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = 32
    order_gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        order = torch.randperm(len(shard), generator=order_gen)
        for i in range(0, len(shard) - batch + 1, batch):
            idx = order[i : i + batch]
            loss = torch.nn.functional.cross_entropy(model(shard.x[idx]), shard.y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    state.close()
    return {
        "accuracy": accuracy(model.module, test.x, test.y),
        "wire_bytes": state.ledger.wire_total,
        "dense_bytes": state.ledger.dense_total,
        "steps": state.step,
    }


def _worker(rank: int, world_size: int, port: int, plan: dict, epochs: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        result = train_digits(rank, world_size, plan, epochs)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run(world_size: int, plan: Plan, epochs: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world_size, port, plan.to_dict(), epochs, queue), nprocs=world_size)
    return queue.get()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.epochs < 1:
        parser.error("--world-size and --epochs must be >= 1")
    print(f"{'method':<14} {'accuracy':>9} {'wire bytes':>12} {'dense bytes':>12} {'ratio':>7}")
    for name, plan in PLANS.items():
        r = run(args.world_size, plan, args.epochs)
        ratio = r["dense_bytes"] / r["wire_bytes"]
        print(
            f"{name:<14} {r['accuracy']:>9.4f} {r['wire_bytes']:>12.0f} {r['dense_bytes']:>12.0f} {ratio:>7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
