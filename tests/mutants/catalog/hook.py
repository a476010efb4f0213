"""The DDP hook: its groups, buckets, sending thread and step boundaries."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "hook-never-ends-step", "compression_hook.receive",
        "        if last:\n            state.end_step()\n",
        "        if False:\n            state.end_step()\n",
        "tests/test_hook.py",
        "the DDP hook never closes the step: plans never install, the step counter stands still",
    ),
    mutant(
        "buckets-auto-is-ddps-default", "ddp_kwargs",
        "        cap = bucket_cap_mb(model)\n        if cap >= MAX_CAP_MB:",
        "        return {}\n        if cap >= MAX_CAP_MB:",
        "tests/test_buckets.py",
        "auto leaves DDP's default buckets: a small model's wire all waits for the end of backward",
    ),
    mutant(
        "buckets-baseline-cap-yields-to-raycomps", "ddp_options",
        "    if benchmark.bucket_cap_mb is not None:\n",
        '    if benchmark.bucket_cap_mb is not None and compression.bucket_cap_mb == "auto":\n',
        "tests/test_buckets.py",
        "the cap meant for torch's PowerSGD (one bucket) gives way to compression.bucket_cap_mb, meant for raycomp's hook",
    ),
    mutant(
        "buckets-below-ddps-first-bucket", "bucket_cap_mb",
        "    return round(min(MAX_CAP_MB, max(MIN_CAP_MB, gradient_mb(model) / buckets)), 2)\n",
        "    return round(min(MAX_CAP_MB, gradient_mb(model) / buckets), 2)\n",
        "tests/test_buckets.py",
        "a small model gets buckets of a few kB: a collective round per layer",
    ),
    mutant(
        "hook-counts-hidden-reductions", "compression_hook.receive",
        "        if last or not state.overlaps:  # what backward, or the step after it, waited for\n",
        "        if True:\n",
        "tests/test_hook.py -k comm_time",
        "a reduction that ran beside backward counts as communication: overlap looks like a slow link",
    ),
    mutant(
        "hook-counts-only-inline-reductions", "compression_hook.receive",
        "        if last or not state.overlaps:  # what backward, or the step after it, waited for\n",
        "        if not state.overlaps:\n",
        "tests/test_hook.py -k comm_time",
        "with the background thread no communication time is reported: every link looks free",
    ),
    mutant(
        "hook-decodes-before-next-send", "BucketThreads.submit.start",
        "                guarded(send, lambda pending: self._receiver.submit(finish, pending))  # type: ignore[union-attr]\n",
        "                guarded(send, finish)\n",
        "tests/test_hook.py",
        "the hook's sending thread also waits for and decodes each bucket: the next bucket is encoded only after this one left the wire",
    ),
    mutant(
        "hook-never-sends-inline", "CompressionState.begin_step",
        "        self._send_inline = not self._threads.enabled or self._dense_everywhere()\n",
        "        self._send_inline = not self._threads.enabled\n",
        "tests/test_hook.py -k issues_its_all_reduces",
        "a dense step still hands every bucket to the sending thread (CPU beside backward on a fast link)",
    ),
    mutant(
        "hook-sends-inline-if-any-layer-dense", "CompressionState._dense_everywhere",
        "            dense = all(self.reducer.transport_for(self.name_of(p), p.shape) is Transport.DENSE\n",
        "            dense = any(self.reducer.transport_for(self.name_of(p), p.shape) is Transport.DENSE\n",
        "tests/test_hook.py -k issues_its_all_reduces",
        "a plan with some dense layers issues from DDP's thread while compressed layers need the sending thread",
    ),
    mutant(
        "hook-shares-ddp-group", "hook_group",
        "        return dist.new_group(timeout=timeout_of(ddp_group or dist.group.WORLD))\n",
        "        return process_group\n",
        "tests/test_hook.py -k collide",
        "the hook's collectives share DDP's group: DDP's used-parameter all-reduce races the last bucket's",
        timeout_s=300,
    ),
    mutant(
        "unused-layer-needs-every-rank", "CompressionState.settle_after_backward.settle",
        "                self.reducer.settle_unused(lambda name: counts[self._map_index[name]] > 0)\n",
        "                self.reducer.settle_unused(lambda name: counts[self._map_index[name]] >= self.reducer.group.size)\n",
        "tests/test_hook.py -k keeps_its_error",
        "a layer counts as used only if every rank used it: an idle rank keeps what it sent into the mean",
    ),
    mutant(
        "hook-never-defers-unused", "CompressionState.__init__",
        "        self.reducer.defer_unused = self._ddp_reducer is not None\n",
        "        self.reducer.defer_unused = False\n",
        "tests/test_hook.py -k keeps_its_error",
        "with find_unused_parameters the memory is updated at once, before DDP says whether anyone used the layer",
    ),
    mutant(
        "settle-queued-outside-backward", "CompressionState.settle_after_backward",
        "        try:\n            engine.queue_callback(lambda: engine.queue_callback(settle))\n"
        "        except RuntimeError:  # not in a backward: DDP's join shadows a step of a joined rank\n"
        "            pass  # begin_step settles them as used\n",
        "        engine.queue_callback(lambda: engine.queue_callback(settle))\n",
        "tests/test_hook.py -k join",
        "a joined rank's shadow step (no backward) tries to queue the settling callback and fails",
    ),
    mutant(
        "hook-group-default-timeout", "hook_group",
        "        return dist.new_group(timeout=timeout_of(ddp_group or dist.group.WORLD))\n",
        "        return dist.new_group()\n",
        "tests/test_hook.py -k within_the_process_group_timeout",
        "the hook's group gets gloo's 30-minute default: a rank that never arrives hangs the others that long",
        timeout_s=300,
    ),
    mutant(
        "hook-allows-ddp-group-with-unused-map", "hook_group",
        '    if process_group is ddp_group and getattr(model, "find_unused_parameters", False):\n',
        '    if process_group is ddp_group and getattr(model, "static_graph", False):\n',
        "tests/test_hook.py -k refused",
        "DDP's own group is accepted for the hook while DDP all-reduces its used-parameter map on it",
    ),
)
