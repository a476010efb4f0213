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
        "framework-ddp-without-the-hook", "ddp_hook_sync",
        "        model.register_comm_hook(sync.state, compression_hook)\n",
        "        pass\n",
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
)
