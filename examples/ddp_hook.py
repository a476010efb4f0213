"""raycomp's DDP communication hook in a plain PyTorch DDP script — no Ray.

    python examples/ddp_hook.py --steps 50

Spawns two gloo processes on this machine. Each wraps the model in DDP and registers
raycomp's hook with a fixed plan (PowerSGD rank 2 here; any compressor by name). The state
owns a communication thread: close it when done (it is a context manager too).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import raycomp


def worker(rank: int, world_size: int, steps: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    # buckets of about 1/8 of the model (1-25 MB): each is sent while backward computes the next
    model = DDP(net, bucket_cap_mb=raycomp.bucket_cap_mb(net))
    plan = raycomp.Plan.uniform("powersgd", rank=2)  # or "topk" with ratio=0.01, "int8", ...
    state = raycomp.CompressionState(model, plan, memory="residual", min_compress_numel=1024)
    model.register_comm_hook(state, raycomp.compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    weights = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    try:
        for step in range(steps):
            x = torch.randn(32, 64, generator=gen)
            loss = nn.functional.cross_entropy(model(x), (x @ weights).argmax(1))
            optimizer.zero_grad()
            loss.backward()  # the hook compresses and all-reduces each bucket
            optimizer.step()
            if rank == 0 and (step + 1) % 10 == 0:
                print(f"step {step + 1}: loss {loss.item():.3f}, compression "
                      f"{state.ledger.compression_ratio or 1:.1f}x", flush=True)
    finally:
        state.close()  # the hook's communication thread
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args(argv)
    mp.spawn(worker, args=(2, args.steps, args.port), nprocs=2)


if __name__ == "__main__":
    main()
