"""Your Hugging Face Trainer on Ray Train, with adaptive gradient compression from raycomp.

    pip install "./raycomp[transformers]"    # from a checkout, or the wheel (README: Install)
    python examples/transformers_ray_train.py --workers 2 --epochs 3

Ray's recipe for the Trainer (``TorchTrainer``, ``RayTrainReportCallback``,
``prepare_trainer``, resuming from ``ray.train.get_checkpoint()``) with the lines marked
``# raycomp`` changed: raycomp's ``prepare_trainer`` in place of Ray's, and the controller's
callback in the ``RunConfig``. The Trainer keeps its loop, optimizer step, gradient
accumulation and mixed precision; raycomp compresses the gradients as the controller
decides, falls back to dense when training goes wrong, and checkpoints its state inside
the Trainer's checkpoints. A two-layer GPT-2 built from its config (nothing downloaded) on
tokenizer-free sequences; copy it and put your model and data in.

The policy is raycomp's default, ``adaptive``: it times the link and compresses only where
that saves time, so on one machine's loopback it rightly stays dense. ``--bandwidth``
(bytes/s per rank, e.g. 12.5e6 for 100 Mbit/s) has it plan for a slower link instead.
Under AdamW it offers only int4, int8 and bf16 (``lossy: auto``): on the project's AdamW
transformer Top-K and PowerSGD lost validation loss (docs/benchmarks/).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.huggingface.transformers import RayTrainReportCallback
from ray.train.torch import TorchTrainer
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import raycomp.train  # raycomp
from raycomp.config import AdaptiveOptions, CompressionSection, ControllerSection  # raycomp
from raycomp.integrations.transformers import prepare_trainer  # raycomp: was Ray's prepare_trainer

VOCAB, LENGTH = 64, 32


def sequences(n: int, seed: int) -> list[dict]:
    """Arithmetic sequences modulo VOCAB, start and stride drawn: learnable from context."""
    gen = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": t, "labels": t} for t in tokens]


def train_func(config: dict) -> dict:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=VOCAB, n_positions=LENGTH,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        output_dir=f"{config['output_dir']}/hf", num_train_epochs=config["epochs"], per_device_train_batch_size=8,
        gradient_accumulation_steps=config["accumulate"], learning_rate=3e-3, eval_strategy="epoch",
        save_strategy="epoch", logging_steps=10, report_to="none", disable_tqdm=True,
        bf16=config["bf16"], use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=sequences(config["sequences"], seed=1),
                      eval_dataset=sequences(128, seed=2), callbacks=[RayTrainReportCallback()])
    trainer = prepare_trainer(trainer, raycomp.train.TrainOptions(  # raycomp: was prepare_trainer(trainer)
        compression=CompressionSection(warmup_steps=5, adaptive=AdaptiveOptions(bandwidth=config["bandwidth"])),
        controller=ControllerSection(name=config["controller"], interval_steps=5),
        output_dir=config["output_dir"], eval_kind="loss", progress_every=10), monitor="eval_loss")
    checkpoint = ray.train.get_checkpoint()  # a restarted worker group resumes from the latest one
    if checkpoint is None:
        trainer.train()
    else:
        with checkpoint.as_directory() as directory:
            trainer.train(resume_from_checkpoint=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))
    eval_loss = next(h["eval_loss"] for h in reversed(trainer.state.log_history) if "eval_loss" in h)
    return {**trainer.raycomp.totals, "eval_loss": eval_loss}  # raycomp: totals


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=512, help="training sequences (all ranks)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="link bytes/s per rank to plan for (default: measured)")
    parser.add_argument("--storage", default=tempfile.mkdtemp(prefix="raycomp-example-"))
    parser.add_argument("--name", default="transformers-example")
    parser.add_argument("--controller", default="raycomp-controller")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init()
    controller = ControllerSection(name=args.controller, metrics_enabled=False)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs, "sequences": args.sequences, "bf16": args.bf16,
                           "accumulate": args.accumulate, "bandwidth": args.bandwidth, "controller": args.controller,
                           "output_dir": f"{args.storage}/{args.name}"},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name=args.name, storage_path=args.storage,
                             callbacks=[raycomp.train.ControllerCallback(controller)]))  # raycomp
    totals = trainer.fit().return_value
    print(f"eval loss {totals['eval_loss']:.3f}, {totals['steps']} steps, compression "
          f"{totals['dense_bytes_total'] / max(1.0, totals['wire_bytes_total']):.1f}x, "
          f"plan switches {totals['plan_switches']}")
    return totals


if __name__ == "__main__":
    main()
