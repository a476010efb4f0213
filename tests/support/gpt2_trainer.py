"""A two-layer GPT-2 built from its config class on tokenizer-free sequences (nothing
downloaded), in a Hugging Face Trainer that can inject a NaN loss, and raycomp's options,
for the tests that run the Trainer (tests/test_transformers.py, the switched testbed's
tests/support/switch_frameworks.py)."""

from __future__ import annotations

import torch
import transformers

VOCAB, LENGTH, SEQUENCES, BATCH = 64, 24, 256, 8  # an epoch: 256 / (2 ranks x 8) = 16 steps


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=LENGTH,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def sequences(n: int, seed: int) -> list[dict]:
    """Arithmetic sequences modulo VOCAB (start and stride drawn): learnable from context."""
    gen = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=gen), torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": t, "labels": t} for t in tokens]


class FaultyTrainer(transformers.Trainer):
    """A Trainer whose loss is NaN on rank ``nan_rank`` at global step ``nan_at`` (a fault)."""

    nan_at: int | None = None
    nan_rank = 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step == self.nan_at and self.args.process_index == self.nan_rank:
            loss = loss * float("nan")
        return loss


def hf_trainer(output_dir: str, seed: int = 0, callbacks=(), nan_at: int | None = None,
               **args) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=32,
        learning_rate=3e-3, warmup_steps=0, num_train_epochs=args.pop("epochs", 2), eval_strategy="epoch",
        save_strategy=args.pop("save_strategy", "no"), logging_steps=1000, report_to="none",
        disable_tqdm=True, seed=0, use_cpu=True, **args)
    trainer = FaultyTrainer(model=gpt2(), args=arguments, train_dataset=sequences(SEQUENCES, seed),
                            eval_dataset=sequences(64, 999), callbacks=list(callbacks))
    trainer.nan_at = nan_at
    return trainer


def options(config: dict, run: str, **compression):
    import raycomp.train
    from raycomp.config import CompressionSection, ControllerSection

    return raycomp.train.TrainOptions(
        compression=CompressionSection(**compression),
        controller=ControllerSection(name=config["controller"], interval_steps=2),
        output_dir=f"{config['output_dir']}/{run}", run_id=f"{run}-{config['controller']}", eval_kind="loss")


def static(name: str, **params) -> dict:
    """``compression`` options: the static policy with one compressor from the first step."""
    from raycomp.config import compressor
    from raycomp.controllers.policies import StaticOptions

    return {"policy": "static", "warmup_steps": 0, "static": StaticOptions(compressor=compressor(name, **params))}
