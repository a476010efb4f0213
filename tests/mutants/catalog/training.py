"""The worker guard, raycomp.train's loop and the job that drives it."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "checkpoint-drops-ef-residuals", "own_state",
        '        "compression": loop.state.state_dict(), "guard": loop.guard.state_dict(),\n',
        '        "compression": {**loop.state.state_dict(), "memory": {"residuals": {}}},\n'
        '        "guard": loop.guard.state_dict(),\n',
        "tests/test_train_job.py -k step_checkpoints_resume_mid_epoch",
        "the Ray Train checkpoint (rank*.pt) drops the error-feedback residuals",
    ),
    mutant(
        "resume-from-a-finished-runs-checkpoint", "restore",
        "    if found.path in _finished_runs:\n",
        "    if False:\n",
        "tests/test_train_job.py -k each_start_fresh",
        "a second run in the same training function resumes from the first run's last checkpoint",
    ),
    mutant(
        "final-report-not-awaited", "StatsReporter.send",
        "                ray.get(ref, timeout=10)\n",
        "                pass\n",
        "tests/test_train_report.py -k final",
        "the last statistics are sent but not waited for: rank 0 may summarise the run before they arrive",
    ),
    mutant(
        "evaluation-after-the-last-boundary-not-sent", "StatsReporter.send",
        "        elif not (final and (self.eval_metric is not None or self.events)\n",
        "        elif not (final and False\n",
        "tests/test_train_report.py",
        "a run that ends on a boundary never tells the controller the evaluation it made after it",
    ),
    mutant(
        "final-report-outage-counted-twice", "StatsReporter.send",
        "            ref = self.controller.ingest.remote(stats.to_dict())\n"
        "            if final:",
        "            ref = self.controller.ingest.remote(stats.to_dict())\n"
        "            self._pending.append(ref)  # a final call stays pending too\n"
        "            if final:",
        "tests/test_train_report.py -k refuses",
        "a final report the controller refused is read again by close() and counted as a second outage",
    ),
    mutant(
        "guard-ignores-nonfinite", "Guard._trigger",
        '        if nonfinite or (loss is not None and (loss != loss or loss in (float("inf"), float("-inf")))):\n',
        "        if False:\n",
        "tests/test_guard.py",
        "the guard never falls back (or skips) on NaN/Inf gradients or loss",
    ),
    mutant(
        "guard-never-recovers", "Guard.observe",
        "            if self.clean_steps >= self.stable_steps:\n",
        "            if self.clean_steps > 10 ** 9:\n",
        "tests/test_guard.py",
        "after a fallback the guard never resumes compression",
    ),
    mutant(
        "skipped-step-applied", "TrainLoop.step",
        "        if applied:\n            self.lr_ramp.optimizer_step(self.optimizer, self.global_step)\n",
        "        if True:\n            self.lr_ramp.optimizer_step(self.optimizer, self.global_step)\n",
        "tests/test_train_job.py -k nan_gradients",
        "a step the guard skips (NaN/Inf gradients) still reaches the optimizer",
    ),
    mutant(
        "evaluation-counted-as-step-time", "TrainLoop.record_eval",
        "        self._restart_step_clock()  # the evaluation ran since the last step: not step time\n",
        "",
        "tests/test_train_job.py -k stop_at_target",
        "an evaluation's time lands in the next step's: the cost model sees inflated compute",
    ),
    mutant(
        "report-counted-as-step-time", "TrainLoop.report",
        "        self._restart_step_clock()  # the report (a barrier) and what came before it: not step time\n",
        "",
        "tests/test_train_job.py -k stop_at_target",
        "an epoch-end report's time (its barrier, the epoch's evaluation) lands in the next step's",
    ),
    mutant(
        "plan-digest-check-removed", "PlanAgreement.agree",
        "        digest = installed.digest()  # 63 bits: two exact float64 halves\n",
        "        digest = 0  # every rank reports the same constant\n",
        "tests/test_faults.py -k forced_plan_disagreement",
        "ranks compare a constant instead of the plan's fingerprint: disagreement goes unnoticed",
    ),
    mutant(
        "kjv-lstm-builds-the-transformer", "_kjv",
        '    if config.model == "lstm":\n',
        '    if config.model == "gru":\n',
        "tests/test_workloads.py -k lstm",
        "workload.model: lstm silently trains the character transformer",
    ),
    mutant(
        "lossy-auto-for-every-optimizer", "lossy_suits",
        "    return isinstance(optimizer, LINEAR_IN_GRADIENT)\n",
        "    return True\n",
        "tests/test_lossy.py",
        "AdamW runs get the lossy rungs that error feedback cannot make work with it",
    ),
    mutant(
        "lossy-auto-empties-the-ladder", "lossy_setting",
        "    return \"always\" if lossy_suits(optimizer) or not adaptive.near_lossless else \"never\"\n",
        "    return \"always\" if lossy_suits(optimizer) else \"never\"\n",
        "tests/test_lossy.py",
        "near_lossless: [] with AdamW leaves no rung but dense",
    ),
    mutant(
        "lossy-auto-never-resolved", "resolve_options",
        '    update: dict[str, Any] = {"lossy": lossy_setting(compression.adaptive, optimizer)}\n',
        "    update: dict[str, Any] = {}\n",
        "tests/test_train_job.py::test_stop_at_target_leaves_after_the_second_consecutive_evaluation_on_every_rank",
        "prepare_model never resolves lossy: auto, so an AdamW run is offered PowerSGD and Top-K",
    ),
    mutant(
        "buckets-not-given-to-ddp", "ddp_strategy",
        "    model = wrap_ddp(model, setup, ddp_kwargs(setup.options.compression, model))\n",
        "    model = wrap_ddp(model, setup, {})\n",
        "tests/test_train_job.py -k critical_policy_switches",
        "raycomp.train.prepare_model builds DDP with its default buckets, whatever compression.bucket_cap_mb says",
    ),
    mutant(
        "find-unused-not-given-to-ddp", "wrap_ddp",
        "        ddp_options[\"find_unused_parameters\"] = True\n",
        "        pass\n",
        "tests/test_train_job.py -k skips_parameters",
        "TrainOptions.find_unused_parameters never reaches DDP: a model that skips a head fails",
    ),
    mutant(
        "job-autocast-never-enabled", "Precision.autocast",
        "        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None)\n",
        "        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=False)\n",
        "tests/test_train_loss_scale.py -k its_precision",
        "workload.precision=bf16/fp16 trains in fp32: the setting is accepted and ignored",
    ),
    mutant(
        "plan-waits-for-the-next-boundary", "TrainLoop._finish_step",
        "        if self.strategy.per_step and self.guard.announced > self.controller_plan.version:\n",
        "        if False:\n",
        "tests/test_plan_latency.py",
        "a plan rank 0 announced is ignored until the next control boundary: decisions take effect K steps late",
    ),
    mutant(
        "report-records-no-evaluation", "TrainLoop.report",
        "        if name is not None and name in metrics and self._evaluated_at != self.global_step:\n",
        "        if False:\n",
        "tests/test_train_report.py -k records_the_evaluation",
        "report({'accuracy': ...}) writes no evals.jsonl line and the controller never sees the value",
    ),
    mutant(
        "no-checkpoint-in-the-last-epoch", "CheckpointSection.at_report",
        "        if epochs is not None and epoch + 1 >= epochs:\n",
        "        if False:\n",
        "tests/test_train_report.py -k last_epoch",
        "by default a run never checkpoints: its trained model and compression state are lost",
    ),
    mutant(
        "loop-no-early-first-boundary", "TrainLoop._finish_step",
        "        if self.global_step % self.interval == 0 or self.global_step == self.first_boundary:\n",
        "        if self.global_step % self.interval == 0:\n",
        "tests/test_fsdp_job.py -k slow_link",
        "the first boundary waits for K steps: the warm-up sends dense until the link has been timed by all of them",
    ),
)

