"""The shipped workloads, each: model, data order by (seed, epoch, step), evaluation.

* ``digits``: an MLP on sklearn's digits (fast tests);
* ``fashion_mnist``: a small CNN (``model: cnn``) or a 2.5M-parameter BatchNorm CNN
  (``model: bn_cnn``, ``jobs/configs/cnn_fashion.yaml``) on Fashion-MNIST;
* ``kjv``: a decoder-only character transformer on the King James Bible (its size from
  ``model_width``/``model_layers``/``model_heads``/``block``; ``jobs/configs/gpt_kjv.yaml``
  is the 3.2M-parameter one), or a stacked character LSTM (``model: lstm``, its size from
  ``model_width``/``model_layers``; ``jobs/configs/lstm_kjv.yaml``, 1.1M parameters);
* ``workload.entrypoint=pkg.mod:build``: a user workload, any callable with the signature of
  :func:`build` returning a :class:`Workload`.

Data order depends only on ``(seed, epoch, step, rank)`` — never on how many times a worker
restarted — so a run resumed from a checkpoint sees exactly the batches it would have.
Evaluation uses a fixed validation set (the same examples or windows every time, no RNG),
so evaluations are comparable across steps, ranks, runs and methods.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from jobs import data, models
from jobs.config import WorkloadSection, load_config, resolve_entrypoint

CONFIGS = Path(__file__).resolve().parent / "configs"

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    model: nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    steps_per_epoch: int
    batches: Callable[[int, int], Iterator[Batch]]  # (epoch, first step) -> this rank's batches
    evaluate: Callable[[nn.Module], float]
    metric: str  # "accuracy" (higher is better) or "loss" (lower is better)

    @property
    def lower_is_better(self) -> bool:
        return self.metric == "loss"

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def build(config: WorkloadSection, rank: int, world_size: int, seed: int) -> Workload:
    """This rank's workload; the model's initial weights depend on ``seed`` only."""
    if config.entrypoint is not None:
        workload = resolve_entrypoint(config.entrypoint)(config, rank, world_size, seed)
        if not isinstance(workload, Workload):
            raise TypeError(f"workload.entrypoint: {config.entrypoint} returned "
                            f"{type(workload).__name__}, not a jobs.workloads.Workload")
        return workload
    torch.manual_seed(seed)  # identical initial weights on every rank
    if config.name == "kjv":
        return _kjv(config, rank, world_size, seed)
    if config.name == "digits":
        train, test = data.digits(seed=seed)
        model = models.mlp(hidden=config.model_width or 512)
    else:
        train, test = data.fashion_mnist(config.data_dir or data.FASHION_MNIST_DIR)
        if config.model == "bn_cnn":
            model = models.bn_cnn(hidden=config.model_width or 384)
        else:
            model = models.fashion_cnn()
    if config.eval_examples:  # the first N test examples: a fixed, cheaper validation set
        test = data.Split(test.x[:config.eval_examples], test.y[:config.eval_examples])
    return _classification(config, model, train, test, rank, world_size, seed)


def metric_of(config: WorkloadSection, seed: int = 0) -> str:
    """The workload's evaluation metric ("accuracy" or "loss") without loading its data
    for the shipped ones (an entry point is built to ask it)."""
    if config.entrypoint is not None:
        return build(config, 0, 1, seed).metric
    return "loss" if config.name == "kjv" else "accuracy"


def _classification(config: WorkloadSection, model: nn.Module, train: data.Split, test: data.Split,
                    rank: int, world_size: int, seed: int) -> Workload:
    global_batch = config.batch_size * world_size
    steps = len(train) // global_batch
    if config.steps_per_epoch:
        steps = min(steps, config.steps_per_epoch)
    if steps < 1:
        raise ValueError(f"workload.batch_size: {config.batch_size} x {world_size} workers exceeds "
                         f"the {len(train)} training examples")

    def batches(epoch: int, start: int) -> Iterator[Batch]:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for step in range(start, steps):
            # rank r takes slice r of global batch `step`: the union is independent of rank
            idx = order[step * global_batch:(step + 1) * global_batch][rank::world_size]
            yield train.x[idx], train.y[idx]

    return Workload(model, nn.functional.cross_entropy, steps, batches,
                    lambda m: models.accuracy(m, test.x, test.y), "accuracy")


def _kjv(config: WorkloadSection, rank: int, world_size: int, seed: int) -> Workload:
    corpus = data.kjv_corpus(max_chars=config.max_chars)
    if config.model == "lstm":
        model = models.char_lstm(corpus.vocab_size, d_model=config.model_width or 256,
                                 layers=config.model_layers or 2)
    else:
        model = models.char_transformer(corpus.vocab_size, block=config.block, d_model=config.model_width or 128,
                                        heads=config.model_heads or 4, layers=config.model_layers or 2)
    steps = config.steps_per_epoch or 200

    def batches(epoch: int, start: int) -> Iterator[Batch]:
        return corpus.epoch_batches("train", epoch, rank, world_size, config.batch_size,
                                    config.block, steps, seed=seed, start=start)

    return Workload(model, models.lm_loss, steps, batches,
                    lambda m: models.evaluate_lm(m, corpus.test, config.block, batches=config.eval_batches),
                    "loss")


def optimizer_for(config: WorkloadSection, model: nn.Module, total_steps: int):
    if config.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                                       weight_decay=config.weight_decay)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                              weight_decay=config.weight_decay)
    warmup = min(config.lr_warmup_steps, max(0, total_steps - 1))
    if warmup:
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_then(config.lr_schedule, warmup, total_steps))
    if config.lr_schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total_steps))
    else:
        scheduler = None
    return opt, scheduler


def warmup_then(schedule: str, warmup: int, total_steps: int):
    """The LR factor at each step: (s + 1) / warmup for the first ``warmup`` steps, then 1
    (``constant``) or a cosine from 1 to 0 over the remaining steps (``cosine``)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))
    return factor


def model_of(config_name: str, seed: int = 0) -> nn.Module:
    """The model a shipped job config (``jobs/configs/<config_name>.yaml``) trains, with the
    initial weights the job gives it for ``seed``."""
    return build(load_config(CONFIGS / f"{config_name}.yaml").workload, 0, 1, seed).model


def layer_sizes(config: WorkloadSection, seed: int) -> dict[str, int]:
    """Parameter name -> element count, as the controller needs them (built on the driver)."""
    model = build(config, 0, 1, seed).model
    return {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
