"""The reducer: plans, the finite flag, error feedback of unused layers, statistics."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "ef-skipped-for-sparse", "HeldBackUpdates.update",
        "                else:\n                    memory.update(name, compensated[i], sent, compressor.sparse)\n",
        "                elif not compressor.sparse:\n"
        "                    memory.update(name, compensated[i], sent, compressor.sparse)\n",
        "tests/test_error_feedback.py",
        "the reducer skips the memory update for sparse compressors (Top-K, DGC, threshold, Random-K)",
    ),
    mutant(
        "state-dict-drops-ef-residuals", "CompressedReducer.state_dict",
        '            "memory": self.memory.state_dict(),\n',
        '            "memory": type(self.memory)().state_dict(),\n',
        "tests/test_hook.py -k state_dict_resume",
        "CompressedReducer.state_dict saves an empty memory: resume loses the residuals",
    ),
    mutant(
        "plan-installed-one-step-late-on-one-rank", "CompressedReducer.set_plan",
        "        if self._in_step:\n            self._pending = plan\n",
        "        if self._in_step or self.group.rank == 1:\n            self._pending = plan\n",
        "tests/test_hook.py -k plan_swapped",
        "rank 1 defers a plan set between steps to the end of the next step",
        ("CompressedReducer.begin_step",
         "        if self._pending is not None:\n            self._plan, self._pending = self._pending, None\n"
         "        if self.holding_back:",
         "        if self._pending is not None and self.group.rank != 1:\n"
         "            self._plan, self._pending = self._pending, None\n        if self.holding_back:"),
    ),
    mutant(
        "finite-flag-reads-max-only", "all_finite",
        "        return torch.isfinite(torch.stack([torch.stack(torch.aminmax(t)).float() for t in present])).all()\n",
        "        return torch.isfinite(torch.stack([t.amax().float() for t in present])).all()\n",
        "tests/test_hook.py",
        "the step's non-finite flag misses -inf (it reads only the maximum)",
    ),
    mutant(
        "dense-in-place-on-statistics-steps", "CompressedReducer._send",
        "        overwritable = [overwrite and not measuring and c is g for c, g in zip(compensated, grads, strict=True)]\n",
        "        overwritable = [overwrite and c is g for c, g in zip(compensated, grads, strict=True)]\n",
        "tests/test_hook.py",
        "a statistics step reduces the bucket in place: the layers' gradient norms are the mean's",
    ),
    mutant(
        "dense-in-place-in-memory-buffer", "CompressedReducer._send",
        "        overwritable = [overwrite and not measuring and c is g for c, g in zip(compensated, grads, strict=True)]\n",
        "        overwritable = [overwrite and not measuring for c, g in zip(compensated, grads, strict=True)]\n",
        "tests/test_hook.py",
        "an in-place dense reduction divides a buffer the error-feedback memory handed back",
    ),
    mutant(
        "stats-grad-norm-of-compensated", "layer_stats",
        "             of_compensated if compensated is grad else norm(grad.float()),  # no residual: the same norm\n",
        "             of_compensated,\n",
        "tests/test_hook.py -k statistics_tell",
        "the statistics report the norm of gradient plus residual as the gradient's norm",
    ),
    mutant(
        "stats-error-relative-to-gradient", "layer_stats",
        "    error = error_norm / compensated_norm if compensated_norm > 0 else 0.0  # 0 when all was sent\n",
        "    error = error_norm / grad_norm if compensated_norm > 0 else 0.0  # 0 when all was sent\n",
        "tests/test_hook.py -k statistics_tell",
        "the compression error is measured against the gradient, not what was compressed (gradient plus residual)",
    ),
    mutant(
        "unused-layer-residual-spent", "HeldBackUpdates.settle",
        "                memory.update(name, compensated, torch.zeros_like(sent), False)\n",
        "                memory.update(name, compensated, sent, sparse)\n",
        "tests/test_hook.py -k keeps_its_error",
        "a layer no rank used loses from its residual what was sent, though DDP dropped that mean",
    ),
    mutant(
        "held-updates-left-over", "CompressedReducer.begin_step",
        "        if self.holding_back:  # nothing settled the last step's (no backward ran it): as sent\n",
        "        if False:  # nothing settled the last step's (no backward ran it): as sent\n",
        "tests/test_hook.py -k held_back",
        "updates no callback settled stay held back: the next step compensates with a stale residual",
    ),
    mutant(
        "finite-flag-checks-dense-layers-only", "CompressedReducer._send",
        "                            if kind is not Transport.DENSE and not c.carries_nonfinite])\n",
        "                            if kind is Transport.DENSE and not c.carries_nonfinite])\n",
        "tests/test_hook.py -k covers_compressed",
        "a compressed layer's NaN is not flagged: a compressor may drop it from the mean and the guard never skips the step",
    ),
    mutant(
        "checkpoint-without-held-updates", "CompressedReducer.state_dict",
        "        if self.holding_back:  # held back by a step no backward closed: as sent, as the next step would\n",
        "        if False:  # held back by a step no backward closed: as sent, as the next step would\n",
        "tests/test_hook.py -k checkpoint_between_steps",
        "a joined rank checkpointed between a shadow step and its next step saves its memory without the update",
    ),
)
