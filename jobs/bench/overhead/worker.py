"""The overhead benchmark on one Ray Train worker: the same model three times (plain DDP,
raycomp's hook alone, ``raycomp.train``), stepped in blocks, in turn, on the same batches."""

from __future__ import annotations

import copy
import time
from typing import Any

from jobs.bench.overhead.summary import PLANS

__all__ = ["train_func"]


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    """The Ray Train worker: ``pairs + warmup_pairs`` block pairs of the three sides; each
    block's seconds, how raycomp's steps travelled and the run's totals."""
    import ray.train
    import ray.train.torch
    import torch
    from torch import nn

    import raycomp
    import raycomp.train
    from jobs.data import fashion_mnist, kjv_corpus
    from jobs.models import char_lstm, fashion_cnn, lm_loss
    from raycomp._internal.ddp.buckets import ddp_kwargs
    from raycomp.config import CompressionSection, ControllerSection

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    block, batch = config["block"], config["batch"]
    pairs = config["pairs"] + config["warmup_pairs"]
    if config["model"] == "lstm":
        corpus = kjv_corpus()

        def build() -> nn.Module:
            return char_lstm(len(corpus.vocab), d_model=128)

        def batches(start: int):
            for i in range(start, start + block):
                x, y = corpus.batch_at("train", 0, i, rank, world, batch, 64)
                yield x, y, len(y)

        def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(model(x), y)
    else:
        train, _ = fashion_mnist()
        train_x, train_y = train.x, train.y
        per_step = batch * world

        def build() -> nn.Module:
            return fashion_cnn()

        def batches(start: int):
            for i in range(start, start + block):
                lo = (i * per_step) % (len(train_y) - per_step)
                x, y = train_x[lo + rank:lo + per_step:world], train_y[lo + rank:lo + per_step:world]
                yield x, y, len(y)

        def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y)

    torch.manual_seed(0)
    plain_model = build()
    own_model, hook_model = copy.deepcopy(plain_model), copy.deepcopy(plain_model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    own_opt = torch.optim.SGD(own_model.parameters(), lr=0.01, momentum=0.9)
    hook_opt = torch.optim.SGD(hook_model.parameters(), lr=0.01, momentum=0.9)
    plain = ray.train.torch.prepare_model(plain_model)
    compressor = PLANS[config["plan"]][0]
    if compressor == "bf16":  # torch's own cast hook: the reference side
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def casted(state, bucket):  # unannotated: DDP checks a hook's annotations (CUDA only for bf16)
            return default_hooks.bf16_compress_hook(state, bucket)

        plain.register_comm_hook(None, casted)
    options = raycomp.train.TrainOptions(
        compression=CompressionSection.model_validate(
            {"policy": "static", "warmup_steps": 0, "static": {"compressor": {"name": compressor}},
             "bucket_cap_mb": config["bucket_cap_mb"]}),
        controller=ControllerSection(name=config["controller"], metrics_enabled=False,
                                     dense_control=config["dense_control"]),
        output_dir=config["output_dir"], progress_every=0)
    own = raycomp.train.prepare_model(own_model, own_opt, options=options)
    loop = raycomp.train.current()
    # raycomp's hook alone, on raycomp's buckets: what the loop's control work comes on top of
    hook = ray.train.torch.prepare_model(hook_model, parallel_strategy_kwargs=ddp_kwargs(options.compression,
                                                                                          hook_model))
    hook_state = raycomp.CompressionState(hook, raycomp.Plan.uniform(compressor))
    hook.register_comm_hook(hook_state, raycomp.compression_hook)

    def ddp_block(model: nn.Module, optimizer: torch.optim.Optimizer, start: int) -> float:
        began = time.perf_counter()
        for x, y, _ in batches(start):
            loss_of(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return time.perf_counter() - began

    def own_block(start: int) -> float:
        began = time.perf_counter()
        for x, y, samples in batches(start):
            loss = loss_of(own, x, y)
            loss.backward()
            raycomp.train.step(loss, samples=samples)
        return time.perf_counter() - began

    sides = {"plain_s": lambda start: ddp_block(plain, plain_opt, start),
             "hook_s": lambda start: ddp_block(hook, hook_opt, start), "raycomp_s": own_block}
    rows = []
    for _ in loop.epochs(1, pairs * block):
        for pair in range(pairs):
            order = list(sides) if pair % 2 == 0 else list(reversed(sides))
            times = {side: sides[side](pair * block) for side in order}
            rows.append({"pair": pair, **times, "counted": pair >= config["warmup_pairs"]})
    # how raycomp.train's steps travelled: the count the DDP strategy keeps of each way
    travelled = getattr(loop.strategy, "sync", None)
    ways = {} if travelled is None else {way.value: n for way, n in travelled.steps.items()}
    handoff = loop.handoff  # when plans take effect: every K steps, the first boundary, the agreement
    places = {"interval": handoff.interval, "first": handoff.first_boundary, "agree_after": handoff.agree_after,
              "steps_log": str(loop.log.path)}
    # the boundaries' own work runs after a step's clock stops (the step log leaves it out)
    boundary_ms = 1e3 * loop.clock.boundary_seconds / max(1, loop.global_step)
    totals = raycomp.train.finish()
    hook_state.close()
    return {"rows": rows, "plan": totals["final_plan"], "steps": totals["steps"], "ways": ways, "places": places,
            "boundary_ms_per_step": boundary_ms,
            "wire_bytes_total": totals["wire_bytes_total"], "dense_bytes_total": totals["dense_bytes_total"],
            "controller_outages": totals["controller_outages"], "stats_dropped": totals["stats_dropped"]}
