"""The framework integrations: the step a framework drives, its checkpoints, its DDP model."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "framework-skip-applied", "FrameworkStep.before_optimizer_step",
        "            self.loop.optimizer.zero_grad(set_to_none=True)\n",
        "            pass\n",
        "tests/test_lightning.py -k guard_falls_back",
        "a step the guard skips still reaches the framework's optimizer: NaN gradients are applied",
        timeout_s=600,
    ),
    mutant(
        "lightning-raycomp-state-not-resumed", "RaycompStrategy.load_checkpoint",
        "        own = state_files.load_state(state_dir(checkpoint_path), self.global_rank, self.world_size)\n",
        "        own = None\n",
        "tests/test_lightning.py -k killed",
        "a resumed Lightning run keeps Lightning's state but restarts raycomp's residuals and guard",
        timeout_s=600,
    ),
    mutant(
        "framework-ddp-without-the-hook", "ddp_hook_strategy",
        "    return DdpStrategy(model, compression_state(model, setup))\n",
        "    return DdpStrategy(model, compression_state(model, setup), hook=None)\n",
        "tests/test_lightning.py -k every_gradient_byte",
        "the framework's DDP all-reduces dense gradients itself, raycomp's hook never runs",
        timeout_s=600,
    ),
    mutant(
        "trainer-raycomp-state-not-resumed", "RaycompCallback.on_train_begin",
        "            own = state_files.load_state(self.resume_from / STATE_DIR, rank, world)\n",
        "            own = None\n",
        "tests/test_transformers.py -k killed",
        "a resumed Trainer run keeps the Trainer's state but restarts raycomp's residuals and guard",
        timeout_s=600,
    ),
    mutant(
        "trainer-loss-not-read", "_RaycompTrainer.training_step",
        "        self.raycomp.add(loss, batch_size(inputs))\n",
        "        pass\n",
        "tests/test_transformers.py -k guard_falls_back",
        "the guard and the step log never see the Trainer's loss: loss spikes go unnoticed",
        timeout_s=600,
    ),
    mutant(
        "framework-loss-of-last-micro-batch", "FrameworkStep.add",
        "        self._loss = loss if self._loss is None else self._loss + loss\n",
        "        self._loss = loss\n",
        "tests/test_lightning.py -k bf16_with_gradient_accumulation",
        "under gradient accumulation the guard and the step log see the last micro-batch's share of the loss",
        timeout_s=600,
    ),
    mutant(
        "lightning-last-step-unknown", "_StepCallback.on_train_start",
        "            self.strategy.loop.last_step = int(budget) if math.isfinite(budget) else None\n",
        "            pass\n",
        "tests/test_lightning_local.py",
        "Lightning's last optimizer step leaves each rank its own replica: the last checkpoint holds rank 0's",
        timeout_s=600,
    ),
    mutant(
        "trainer-last-step-unknown", "RaycompCallback.on_train_begin",
        "        self.loop.last_step = state.max_steps if state.max_steps > 0 else None  # optimizer steps in all\n",
        "",
        "tests/test_transformers.py -k local_steps_under_the_trainer",
        "the Trainer's last optimizer step leaves each rank its own replica: its last evaluation and save see rank 0's",
        timeout_s=600,
    ),
)
