"""Mutation check: does the test suite notice when the code is broken on purpose?

    python -m tests.mutants              # every mutant (scripts/mutants.sh is the same)
    python -m tests.mutants --list       # names, files, test selections, whether the snippet is found
    python -m tests.mutants --only NAME  # one mutant (repeatable)
    python -m tests.mutants --baseline   # also run each selection unmutated first

For every mutant the repository's files (tracked, plus untracked files git does not ignore,
as they are in the working tree) are copied into a fresh temporary directory, the mutant's
edits are applied to the copy, and the mutant's test selection runs there with
``PYTHONPATH`` pointing at the copy (Ray workers get it too: ``tests/conftest.py`` passes
the repository the tests live in). Outcomes:

* ``KILLED``   pytest reported a failure (exit 1), or the selection ran past its time limit
* ``SURVIVED`` the selection passed with the code broken: a test is missing
* ``STALE``    an edit's original snippet is not in the file exactly once: the code moved;
               re-point the entry (each mutant is a data-only entry below)
* ``ERROR``    anything else (a selected test file is missing, nothing collected, pytest
               usage error, the unmutated selection fails under ``--baseline``)

The exit status is 0 only when every mutant run was KILLED.

A mutant is an honest bug someone could write; its test selection is the smallest set of
the normal suite's tests that should catch it. No test may be written to match a mutant's
text: a mutant that survives means a behavioural test is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (exact original snippet, replacement), applied in order
    tests: tuple[str, ...]  # pytest arguments (paths, -k expressions)
    why: str  # the bug in one line
    timeout_s: int = DEFAULT_TIMEOUT_S


def mutant(name: str, file: str, original: str, replacement: str, tests: str, why: str,
           *more_edits: tuple[str, str], timeout_s: int = DEFAULT_TIMEOUT_S) -> Mutant:
    return Mutant(name, file, ((original, replacement), *more_edits), tuple(tests.split()), why, timeout_s)


# Each entry: name, file, original snippet (must occur exactly once), replacement, test
# selection, what the bug is. A snippet that no longer occurs exactly once is reported STALE:
# the code moved, and the entry must be re-pointed.
MUTANTS: tuple[Mutant, ...] = (
    # --- error feedback -----------------------------------------------------------------
    mutant(
        "ef-update-removed", "raycomp/memory.py",
        "        self.residuals[name] = compensated.float() - sent.float()\n",
        "        self.residuals.pop(name, None)\n",
        "tests/test_memory.py",
        "ResidualMemory.update never stores the residual: error feedback does nothing",
    ),
    mutant(
        "ef-skipped-for-sparse", "raycomp/reducer.py",
        "                else:\n                    self.memory.update(name, compensated[i], sent, compressor.sparse)\n",
        "                elif not compressor.sparse:\n"
        "                    self.memory.update(name, compensated[i], sent, compressor.sparse)\n",
        "tests/test_error_feedback.py",
        "the reducer skips the memory update for sparse compressors (Top-K, DGC, threshold, Random-K)",
    ),
    mutant(
        "dgc-momentum-masking-removed", "raycomp/memory.py",
        "            self.velocity[name].masked_fill_(sent != 0, 0.0)\n",
        "            pass\n",
        "tests/test_memory.py",
        "DGC momentum-factor masking: the velocity of sent coordinates is not reset",
    ),
    mutant(
        "dgc-momentum-correction-removed", "raycomp/memory.py",
        "        u = g.clone() if u is None else u.to(g.device).mul_(self.momentum).add_(g)\n",
        "        u = g.clone()\n",
        "tests/test_memory.py",
        "DGC accumulates the raw gradient instead of the momentum-corrected velocity",
    ),
    mutant(
        "state-dict-drops-ef-residuals", "raycomp/reducer.py",
        '            "memory": self.memory.state_dict(),\n',
        '            "memory": type(self.memory)().state_dict(),\n',
        "tests/test_hook.py -k state_dict_resume",
        "CompressedReducer.state_dict saves an empty memory: resume loses the residuals",
    ),
    mutant(
        "checkpoint-drops-ef-residuals", "raycomp/train/loop.py",
        '            "compression": self.state.state_dict(), "guard": self.guard.state_dict(),\n',
        '            "compression": {**self.state.state_dict(), "memory": {"residuals": {}}},\n'
        '            "guard": self.guard.state_dict(),\n',
        "tests/test_train_job.py -k step_checkpoints_resume_mid_epoch",
        "the Ray Train checkpoint (rank*.pt) drops the error-feedback residuals",
    ),
    # --- collectives --------------------------------------------------------------------
    mutant(
        "sparse-also-sends-dense", "raycomp/collectives.py",
        "    gathering, overhead = _gather_payloads(payloads, compressors, group)\n\n    def merge(",
        "    group.all_reduce_(torch.cat([t.detach().reshape(-1).float() for t in tensors]))\n"
        "    gathering, overhead = _gather_payloads(payloads, compressors, group)\n\n    def merge(",
        "tests/test_wire.py tests/test_collectives.py",
        "the sparse all-gather path also all-reduces the dense tensor (wire grows, ledger unchanged)",
    ),
    mutant(
        "dense-mean-divided-twice", "raycomp/collectives.py",
        "            for i, mean in zip(members, _split(flat, [tensors[i] for i in members]), strict=True):\n",
        "            flat.div_(group.size)\n"
        "            for i, mean in zip(members, _split(flat, [tensors[i] for i in members]), strict=True):\n",
        "tests/test_collectives.py",
        "dense all-reduce divides by the world size before and after summing",
    ),
    mutant(
        "summable-not-divided", "raycomp/collectives.py",
        "    payloads = [c.compress(t / w) for t, c in zip(tensors, compressors, strict=True)]\n",
        "    payloads = [c.compress(t) for t, c in zip(tensors, compressors, strict=True)]\n",
        "tests/test_hook.py::test_lossless_settings_of_every_transport_give_ddps_mean",
        "casts/Random-K all-reduce the sum, not the mean",
    ),
    mutant(
        "powersgd-no-orthogonalisation", "raycomp/collectives.py",
        "        c.orthogonalize(p.reshape(ref.shape).clone())\n",
        "        p.reshape(ref.shape).clone()\n",
        "tests/test_hook.py::test_powersgd_recovers_an_exactly_low_rank_mean_across_ranks",
        "distributed PowerSGD skips the Gram-Schmidt step between its two all-reduces",
    ),
    mutant(
        "scalable-server-ef-removed", "raycomp/collectives.py",
        "                self.server_residuals[name] = average - comp.decompress(payload).float()\n",
        "                pass\n",
        "tests/test_error_feedback.py",
        "the scalable all-reduce (sign/int8/QSGD) keeps no server-side error feedback",
    ),
    mutant(
        "two-ranks-take-two-rounds", "raycomp/collectives.py",
        "        if w == 2 and self.gather_two_ranks:\n",
        "        if False:\n",
        "tests/test_collectives.py tests/test_wire.py",
        "at W = 2 the scalable all-reduce still takes two rounds and quantizes twice",
    ),
    mutant(
        "gathered-mean-drops-a-peer", "raycomp/collectives.py",
        "            for d in decoded[1:]:  # rank order, the same on every rank\n",
        "            for d in decoded[1:1]:  # rank order, the same on every rank\n",
        "tests/test_collectives.py",
        "the two-rank all-gather averages only the first rank's payload",
    ),
    mutant(
        "adaptive-int8-two-rounds-at-two-ranks", "controllers/policies/adaptive.py",
        "    rounds = {**EXTRA_ROUNDS, SCALABLE: 1} if world_size == 2 else EXTRA_ROUNDS\n",
        "    rounds = EXTRA_ROUNDS\n",
        "tests/test_adaptive_policy.py",
        "the adaptive policy prices int8 at two extra rounds where two ranks take one",
    ),
    mutant(
        "adaptive-quantizers-round-once-each", "controllers/policies/adaptive.py",
        "    return {b: rounds[b] for b in sorted(batches) if rounds.get(b)}\n",
        "    return {b: rounds[b] * (sum(f in QUANTIZED for f in families) if b == SCALABLE else 1)\n"
        "            for b in sorted(batches) if rounds.get(b)}\n",
        "tests/test_adaptive_policy.py",
        "int4 and int8 layers are priced as two batches where the reducer sends them in one",
    ),
    mutant(
        "adaptive-error-count-restarts-on-rank-change", "controllers/policies/adaptive.py",
        "            if old is None or ladders[name][old].name != ladders[name][rung].name:\n",
        "            if old != rung:\n",
        "tests/test_adaptive_policy.py",
        "a PowerSGD rank change restarts the layer's error count",
    ),
    mutant(
        "adaptive-error-raise-keeps-the-old-samples", "controllers/policies/adaptive.py",
        "            self.error_floor[name], self.rung_since[name] = raised, run.step  # judge anew from here\n",
        "            self.error_floor[name] = raised\n",
        "tests/test_adaptive_policy.py",
        "after a floor moved for error, the old rung's samples judge the new one",
    ),
    mutant(
        "adaptive-int4-priced-as-int8", "controllers/policies/adaptive.py",
        "                total += allreduce * QUANTIZERS[spec.name].wire_bytes(h.numel)\n",
        "                total += allreduce * QUANTIZERS[\"int8\"].wire_bytes(h.numel)\n",
        "tests/test_adaptive_policy.py",
        "the adaptive policy prices int4 at int8's byte an element",
    ),
    mutant(
        "near-lossless-casts-first", "raycomp/config/policies.py",
        "        heaviest = {\"int4\": 0, \"int8\": 1}  # half a byte, one byte, then the casts (two)\n",
        "        heaviest = {\"int4\": 1, \"int8\": 0}  # half a byte, one byte, then the casts (two)\n",
        "tests/test_adaptive_policy.py",
        "int8 sorts before int4: the first near-lossless rung is no longer the heaviest",
    ),
    # --- compressors --------------------------------------------------------------------
    mutant(
        "randomk-ranks-draw-different-indices", "raycomp/compressors/randomk.py",
        "    shared_randomness = True\n",
        "    shared_randomness = False\n",
        "tests/test_collectives.py",
        "Random-K seeds its indices per rank: the all-reduce sums values of different coordinates",
    ),
    mutant(
        "topk-picks-smallest", "raycomp/compressors/topk.py",
        "        indices = torch.topk(flat.abs(), k, sorted=False).indices\n",
        "        indices = torch.topk(flat.abs(), k, largest=False, sorted=False).indices\n",
        "tests/test_compressors.py",
        "Top-K keeps the k smallest magnitudes",
    ),
    mutant(
        "sparse-decompress-off-by-one", "raycomp/compressors/sparse.py",
        "    out.index_put_((indices.long(),), values.to(payload.dtype), accumulate=True)\n",
        "    out.index_put_(((indices.long() + 1) % payload.numel,), values.to(payload.dtype), accumulate=True)\n",
        "tests/test_compressors.py",
        "sparse decompress scatters every value one position too far",
    ),
    mutant(
        "int4-codes-a-byte-each", "raycomp/compressors/minmax.py",
        "        per_byte = 8 // self.bits\n        packed = torch.empty(packed_nbytes(n, self.bits),",
        "        per_byte = 1\n        packed = torch.empty(n,",
        "tests/test_compressors.py tests/test_wire.py",
        "int4 sends a whole byte per 4-bit code",
    ),
    mutant(
        "int8-scale-wrong", "raycomp/compressors/minmax.py",
        "low) / (2**self.bits - 1)).add_(low)\n",
        "low) / 2**self.bits).add_(low)\n",
        "tests/test_compressors.py",
        "int8 dequantisation uses 256 steps where quantisation used 255",
    ),
    mutant(
        "minmax-odd-count-keeps-padding-code", "raycomp/compressors/minmax.py",
        "            count = min(stop * self.chunk_size, n) - first  # the last chunk's padding is not sent\n",
        "            count = min(stop * self.chunk_size, n + n % 2) - first\n",
        "tests/test_compressors.py",
        "int4 with an odd element count sends the padding's code in the last byte's high half",
    ),
    mutant(
        "minmax-blocks-at-int4-offsets", "raycomp/compressors/minmax.py",
        "            written = packed[first // per_byte: first // per_byte + packed_nbytes(count, self.bits)]\n",
        "            written = packed[first // 2: first // 2 + packed_nbytes(count, self.bits)]\n",
        "tests/test_compressors.py",
        "each encoding block's bytes are written at int4's offsets, also for int8 (blocks overlap)",
    ),
    mutant(
        "sign-scale-l2", "raycomp/compressors/sign.py",
        "vector_norm(flat.float(), ord=1)",
        "vector_norm(flat.float(), ord=2)",
        "tests/test_compressors.py",
        "scaled sign uses the L2 norm / N as its scale instead of the mean magnitude",
    ),
    mutant(
        "bitpack-pairs-high-code-dropped", "raycomp/bitpack.py",
        "        return out.copy_(v.bitwise_or(v >> 4))\n",
        "        return out.copy_(v)\n",
        "tests/test_bitpack.py",
        "4-bit codes paired through int16 keep only each pair's first code",
    ),
    mutant(
        "bitpack-pairs-odd-tail-not-zeroed", "raycomp/bitpack.py",
        "        pairs[n:].zero_()  # an odd count's last byte: a zero code in the high half\n",
        "        pairs[n:].fill_(9)\n",
        "tests/test_bitpack.py",
        "an odd count of 4-bit codes leaves a nonzero code in the last byte's high half",
    ),
    mutant(
        "bitpack-unpairs-without-mask", "raycomp/bitpack.py",
        "        pairs.bitwise_or_(pairs << 4).bitwise_and_(0x0F0F)\n",
        "        pairs.bitwise_or_(pairs << 4)\n",
        "tests/test_bitpack.py",
        "4-bit unpacking through int16 leaves the neighbouring code's bits in each code",
    ),
    mutant(
        "torch-noop-all-reduces", "raycomp/baselines.py",
        "        model.register_comm_hook(None, debugging_hooks.noop_hook)\n",
        "        model.register_comm_hook(None, default_hooks.allreduce_hook)\n",
        "tests/test_bench_e2e.py -k noop_hook",
        "the no-communication reference all-reduces: the step ratio's denominator includes the network",
    ),
    mutant(
        "bench-no-comm-one-seed-for-all", "jobs/bench_e2e.py",
        "        m[\"step_vs_no_comm\"] = _median([r[\"step_s\"] / no_comm[r[\"seed\"]] for r in m[\"runs\"]\n",
        "        m[\"step_vs_no_comm\"] = _median([r[\"step_s\"] / no_comm[min(no_comm)] for r in m[\"runs\"]\n",
        "tests/test_bench_e2e.py -k documented_schema",
        "every seed's step is divided by the first seed's no-communication step, not its own group's",
    ),
    mutant(
        "sharded-control-row-via-host", "raycomp/sharded_state.py",
        "    norm_sq = norm_sq.float().reshape(1)\n",
        "    norm_sq = norm_sq.float().reshape(1).cpu()\n",
        "tests/test_device.py -k control_row",
        "FSDP's control row reads the gradient norm on the host: a sync every step on CUDA",
    ),
    mutant(
        "gpu-check-misses-a-compressor", "jobs/gpu_check.py",
        "    \"int4\": {\"chunk_size\": 2048},\n",
        "",
        "tests/test_device.py -k gpu_check",
        "a registered compressor without parameters in the GPU check: KeyError in every CUDA row it is in",
    ),
    mutant(
        "bitpack-shift-off-by-one", "raycomp/bitpack.py",
        "        out |= grid[:, i] << (i * bits)\n",
        "        out |= grid[:, i] << (i * bits - 1)\n",
        "tests/test_bitpack.py",
        "multi-bit packing puts codes 2.. one bit too low",
    ),
    mutant(
        "qsgd-always-rounds-down", "raycomp/compressors/qsgd.py",
        "        level = (scaled + noise).floor_().clamp_(max=self.levels)",
        "        level = (scaled + 0 * noise).floor_().clamp_(max=self.levels)",
        "tests/test_compressors.py",
        "QSGD drops the stochastic rounding: biased",
    ),
    # --- reducer / hook -----------------------------------------------------------------
    mutant(
        "plan-installed-one-step-late-on-one-rank", "raycomp/reducer.py",
        "        if self._in_step:\n            self._pending = plan\n",
        "        if self._in_step or self.group.rank == 1:\n            self._pending = plan\n",
        "tests/test_hook.py -k plan_swapped",
        "rank 1 defers a plan set between steps to the end of the next step",
        ("        if self._pending is not None:\n            self._plan, self._pending = self._pending, None\n"
         "        if self._unsettled:",
         "        if self._pending is not None and self.group.rank != 1:\n"
         "            self._plan, self._pending = self._pending, None\n        if self._unsettled:"),
    ),
    mutant(
        "finite-flag-reads-max-only", "raycomp/reducer.py",
        "    bounds = [torch.stack(torch.aminmax(t)).float() for t in tensors if t.numel()]\n",
        "    bounds = [t.amax().float().reshape(1) for t in tensors if t.numel()]\n",
        "tests/test_hook.py",
        "the step's non-finite flag misses -inf (it reads only the maximum)",
    ),
    mutant(
        "dense-in-place-on-statistics-steps", "raycomp/reducer.py",
        "            in_place = overwrite and not self.collecting_stats and all(compensated[i] is grads[i] for i in members)\n",
        "            in_place = overwrite and all(compensated[i] is grads[i] for i in members)\n",
        "tests/test_hook.py",
        "a statistics step reduces the bucket in place: the layers' gradient norms are the mean's",
    ),
    mutant(
        "dense-in-place-in-memory-buffer", "raycomp/reducer.py",
        "            in_place = overwrite and not self.collecting_stats and all(compensated[i] is grads[i] for i in members)\n",
        "            in_place = overwrite and not self.collecting_stats\n",
        "tests/test_hook.py",
        "an in-place dense reduction divides a buffer the error-feedback memory handed back",
    ),
    mutant(
        "dense-bucket-always-copied", "raycomp/collectives.py",
        "        flat = flat_view([tensors[i] for i in members]) if in_place else None\n",
        "        flat = None\n",
        "tests/test_hook.py",
        "a dense DDP bucket is flattened into a new buffer every step instead of reduced where it lies",
    ),
    mutant(
        "hook-never-ends-step", "raycomp/hook.py",
        "        if last:\n            state.end_step()\n",
        "        if False:\n            state.end_step()\n",
        "tests/test_hook.py",
        "the DDP hook never closes the step: plans never install, the step counter stands still",
    ),
    # --- worker guard and training loop (raycomp/guard.py, raycomp/train/) --------------
    mutant(
        "guard-ignores-nonfinite", "raycomp/guard.py",
        '        if nonfinite or (loss is not None and (loss != loss or loss in (float("inf"), float("-inf")))):\n',
        "        if False:\n",
        "tests/test_guard.py",
        "the guard never falls back (or skips) on NaN/Inf gradients or loss",
    ),
    mutant(
        "guard-never-recovers", "raycomp/guard.py",
        "            if self.clean_steps >= self.stable_steps:\n",
        "            if self.clean_steps > 10 ** 9:\n",
        "tests/test_guard.py",
        "after a fallback the guard never resumes compression",
    ),
    mutant(
        "skipped-step-applied", "raycomp/train/loop.py",
        "        if applied:\n            self.lr_ramp.optimizer_step(self.optimizer, self.global_step)\n",
        "        if True:\n            self.lr_ramp.optimizer_step(self.optimizer, self.global_step)\n",
        "tests/test_train_job.py -k nan_gradients",
        "a step the guard skips (NaN/Inf gradients) still reaches the optimizer",
    ),
    mutant(
        "evaluation-counted-as-step-time", "raycomp/train/loop.py",
        "        self._restart_step_clock()  # the evaluation ran since the last step: not step time\n",
        "",
        "tests/test_train_job.py -k stop_at_target",
        "an evaluation's time lands in the next step's: the cost model sees inflated compute",
    ),
    mutant(
        "report-counted-as-step-time", "raycomp/train/loop.py",
        "        self._restart_step_clock()  # the report (a barrier) and what came before it: not step time\n",
        "",
        "tests/test_train_job.py -k stop_at_target",
        "an epoch-end report's time (its barrier, the epoch's evaluation) lands in the next step's",
    ),
    mutant(
        "plan-digest-check-removed", "raycomp/train/plan_sync.py",
        "        digest = installed.digest()  # 63 bits: two exact float64 halves\n",
        "        digest = 0  # every rank reports the same constant\n",
        "tests/test_faults.py -k forced_plan_disagreement",
        "ranks compare a constant instead of the plan's fingerprint: disagreement goes unnoticed",
    ),
    # --- controller and policies --------------------------------------------------------
    mutant(
        "controller-accepts-nan-stats", "raycomp/messages.py",
        '        for key in _STATS_FLOATS:\n            _finite(f"stats.{key}", data.get(key))\n',
        '        for key in _STATS_FLOATS:\n            pass\n',
        "tests/test_controller.py",
        "GradStats.from_dict lets NaN/Inf/missing run-level statistics through",
    ),
    mutant(
        "controller-accepts-nan-layer-stats", "raycomp/messages.py",
        "            if type(value) is bool or not isfinite(value):\n                return False\n",
        "            if type(value) is bool:\n                return False\n",
        "tests/test_controller.py",
        "per-layer statistics with NaN/Inf pass the controller's fast check",
    ),
    mutant(
        "fallback-gate-removed", "controllers/policies/guarded.py",
        "        if run.fallback_active:\n",
        "        if False:\n",
        "tests/test_policies.py",
        "the controller publishes compressed plans while the workers are in fallback",
    ),
    mutant(
        "error-budget-rounds-down", "controllers/policies/error_budget.py",
        "max(0, math.ceil(e / unit))",
        "max(0, math.floor(e / unit))",
        "tests/test_policies.py",
        "the error-budget DP rounds errors down: the real total can exceed the budget",
    ),
    mutant(
        "critical-regime-inverted", "controllers/policies/critical.py",
        "                critical = abs(prev - cur) / prev >= self.threshold\n",
        "                critical = abs(prev - cur) / prev < self.threshold\n",
        "tests/test_policies.py",
        "Accordion's critical-regime test is inverted",
    ),
    mutant(
        "adaptive-error-moves-one-rank", "controllers/policies/adaptive.py",
        "                raised = max(raised, first)\n",
        "                        pass\n",
        "tests/test_adaptive_policy.py",
        "a layer whose PowerSGD error is too high moves one rank up instead of to int8",
    ),
    mutant(
        "adaptive-floor-change-lowers-shift", "controllers/policies/adaptive.py",
        "            current, self.strikes = max(target, lowest), 0\n",
        "            current, self.strikes = target, 0\n",
        "tests/test_adaptive_policy.py",
        "a layer whose floor rises moves the others heavier at once, without the link rule's patience",
    ),
    mutant(
        "adaptive-calm-keeps-the-level", "controllers/policies/adaptive.py",
        "            kept = [n for n in layers if floors[n] == self.floors.get(n) and n in self.rungs] if raised else []\n",
        "            kept = [n for n in layers if floors[n] == self.floors.get(n) and n in self.rungs]\n",
        "tests/test_adaptive_policy.py",
        "after a critical phase the others stay on the light rungs it allowed, until the link rule's patience",
    ),
    mutant(
        "adaptive-shift-added-to-floor", "controllers/policies/adaptive.py",
        "        return min(max(floor, level), self._cap(ladder))\n",
        "        return min(floor + level, self._cap(ladder))\n",
        "tests/test_adaptive_policy.py",
        "a layer error moved to the near-lossless rungs lands the shift past its floor (int4 + 2 = bf16)",
    ),
    mutant(
        "adaptive-levels-unaligned", "controllers/policies/adaptive.py",
        "        level = shift if shift < lossy else lossy + max(0, shift - levels)\n",
        "        level = shift\n",
        "tests/test_adaptive_policy.py",
        "a ladder with fewer lossy rungs reaches int8 and bf16 at lower shifts than the others",
    ),
    mutant(
        "adaptive-prior-choice-kept", "controllers/policies/adaptive.py",
        "        self.prior_families = self._on_prior(priced[current][1])\n",
        "        self.prior_families = set()\n",
        "tests/test_adaptive_policy.py",
        "a choice made on the assumed round overhead keeps its hysteresis once the overhead is measured",
    ),
    mutant(
        "adaptive-one-overhead-for-every-family", "controllers/policies/adaptive.py",
        "        seconds = sum(r * self.overhead.get(f, self.prior) for f, r in rounds.items())\n",
        "        seconds = sum(rounds.values()) * (max(self.overhead.values()) if self.overhead else self.prior)\n",
        "tests/test_adaptive_policy.py",
        "every collective family is priced at the dearest measured round: PowerSGD at int4's codec cost",
    ),
    mutant(
        "adaptive-new-family-priced-free", "controllers/policies/adaptive.py",
        "        seed = _mean(list(self.overhead.values())) or self.prior\n",
        "        seed = 0.0\n",
        "tests/test_adaptive_policy.py",
        "a family first run beside measured ones gets only what they leave unexplained (often 0 ms)",
    ),
    mutant(
        "adaptive-prior-band-single", "controllers/policies/adaptive.py",
        "            within.append(top)  # on the assumed overhead compression must save more to be used\n",
        "            pass\n",
        "tests/test_adaptive_policy.py",
        "on the assumed round overhead compression starts for any saving past one slack",
    ),
    mutant(
        "adaptive-error-raise-from-floor", "controllers/policies/adaptive.py",
        "            raised = min(max(self.error_floor.get(name, 0), self.rungs[name]) + 1, len(ladder) - 1)\n",
        "            raised = min(self.error_floor.get(name, 0) + 1, len(ladder) - 1)\n",
        "tests/test_adaptive_policy.py",
        "a layer whose near-lossless rung is over max_error goes one rung above its floor (back to PowerSGD)",
    ),
    mutant(
        "adaptive-floor-reaches-dense", "controllers/policies/adaptive.py",
        "        return len(ladder) - (2 if self.near_lossless else 1)\n",
        "        return len(ladder) - 1\n",
        "tests/test_adaptive_policy.py",
        "a critical layer over its error limit is floored at dense, not at bf16",
    ),
    mutant(
        "adaptive-lossy-margin-ignored", "controllers/policies/adaptive.py",
        "        bar = (1 - self.margin) * min(",
        "        bar = min(",
        "tests/test_adaptive_policy.py",
        "a plan with a lossy layer is taken when it is faster at all, not lossy_margin faster",
    ),
    mutant(
        "adaptive-lossy-margin-against-dense", "controllers/policies/adaptive.py",
        "        bar = (1 - self.margin) * min(t for t, risky in zip(self.predicted, lossy, strict=True) if not risky)\n",
        "        bar = (1 - self.margin) * self.predicted[-1]\n",
        "tests/test_adaptive_policy.py",
        "the margin is measured against dense instead of the fastest plan without a lossy layer (int4/int8)",
    ),
    mutant(
        "adaptive-critical-to-first-near-lossless", "controllers/policies/adaptive.py",
        "            floor = min(floor + self.boost, first)\n",
        "            floor = first\n",
        "tests/test_adaptive_policy.py",
        "with lossy rungs a critical layer goes to int4, not critical_boost rungs lighter (Accordion's rank 4)",
    ),
    mutant(
        "adaptive-critical-boosted-past-near-lossless", "controllers/policies/adaptive.py",
        "            floor = min(floor + self.boost, first)\n",
        "            floor = floor + self.boost\n",
        "tests/test_adaptive_policy.py",
        "a critical layer's boost carries it past the first near-lossless rung (Top-K 1% + 3 = int8)",
    ),
    mutant(
        "adaptive-critical-boosts-near-lossless", "controllers/policies/adaptive.py",
        "        if self.critical.get(name) and self.boost and floor < first:\n",
        "        if self.critical.get(name) and self.boost:\n            floor = max(floor, floor + self.boost)\n"
        "        if False:\n",
        "tests/test_adaptive_policy.py",
        "a critical layer already on a near-lossless rung is boosted past it (int8 -> dense's cap, bf16)",
    ),
    mutant(
        "adaptive-sharded-keeps-lossy-rungs", "controllers/policies/adaptive.py",
        "        lossy = ([] if self.sharded or not self.lossy else",
        "        lossy = ([] if not self.lossy else",
        "tests/test_adaptive_policy.py",
        "a sharded run is planned PowerSGD/Top-K, which its reduce-scatter cannot carry",
    ),
    mutant(
        "adaptive-lossy-never-ignored", "controllers/policies/adaptive.py",
        "        lossy = ([] if self.sharded or not self.lossy else",
        "        lossy = ([] if self.sharded else",
        "tests/test_adaptive_policy.py",
        "lossy: never still offers PowerSGD and Top-K",
    ),
    mutant(
        "kjv-lstm-builds-the-transformer", "jobs/workloads.py",
        '    if config.model == "lstm":\n',
        '    if config.model == "gru":\n',
        "tests/test_workloads.py -k lstm",
        "workload.model: lstm silently trains the character transformer",
    ),
    mutant(
        "lossy-auto-for-every-optimizer", "raycomp/train/lossy.py",
        "    return isinstance(optimizer, LINEAR_IN_GRADIENT)\n",
        "    return True\n",
        "tests/test_lossy.py",
        "AdamW runs get the lossy rungs that error feedback cannot make work with it",
    ),
    mutant(
        "lossy-auto-empties-the-ladder", "raycomp/train/lossy.py",
        "    lossy = \"always\" if lossy_suits(optimizer) or not adaptive.near_lossless else \"never\"\n",
        "    lossy = \"always\" if lossy_suits(optimizer) else \"never\"\n",
        "tests/test_lossy.py",
        "near_lossless: [] with AdamW leaves no rung but dense",
    ),
    mutant(
        "lossy-auto-never-resolved", "raycomp/train/loop.py",
        "        options = lossy_options(options, optimizer)  # \"auto\": the optimizer decides\n",
        "",
        "tests/test_train_job.py::test_stop_at_target_leaves_after_the_second_consecutive_evaluation_on_every_rank",
        "prepare_model never resolves lossy: auto, so an AdamW run is offered PowerSGD and Top-K",
    ),
    mutant(
        "adaptive-sharded-priced-as-allreduce", "controllers/policies/adaptive.py",
        "        allreduce = (w - 1) / w if self.sharded else 2 * (w - 1) / w",
        "        allreduce = 2 * (w - 1) / w",
        "tests/test_adaptive_policy.py",
        "a sharded run's bytes are priced as an all-reduce's: its fp32 gradient looks like bf16",
    ),
    # --- sharded data parallel (FSDP2) -------------------------------------------------------
    mutant(
        "sharded-control-never-rides", "raycomp/sharded_state.py",
        "        if self._calls != len(self.comms) or self._control is None:\n",
        "        if True:\n",
        "tests/test_sharded.py",
        "the guard's control floats never ride in the last unit's all-to-all: an extra collective per step",
    ),
    mutant(
        "sharded-plan-not-installed", "raycomp/sharded_state.py",
        "            if spec != comm.spec:\n                comm.set_spec(spec)\n",
        "            pass\n",
        "tests/test_sharded.py",
        "a new plan never reaches the units' comms: FSDP stays on its first plan",
    ),
    mutant(
        "sharded-norm-of-one-rank", "raycomp/sharded_state.py",
        "        return math.sqrt(math.fsum(n * n for n in self.rank_norms) / len(self.rank_norms))\n",
        "        return self.rank_norms[0]\n",
        "tests/test_sharded.py",
        "the guard watches rank 0's gradient norm only",
    ),
    mutant(
        "sharded-resume-drops-residuals", "raycomp/sharded.py",
        "        self.residual = None if residual is None else residual.clone()\n",
        "        self.residual = None\n",
        "tests/test_fsdp_job.py -k bit_for_bit",
        "a resumed sharded run loses every unit's error-feedback residual",
    ),
    mutant(
        "buckets-auto-is-ddps-default", "raycomp/buckets.py",
        "        cap = bucket_cap_mb(model)\n        if cap >= MAX_CAP_MB:",
        "        return {}\n        if cap >= MAX_CAP_MB:",
        "tests/test_buckets.py",
        "auto leaves DDP's default buckets: a small model's wire all waits for the end of backward",
    ),
    mutant(
        "buckets-baseline-cap-for-raycomp-too", "raycomp/buckets.py",
        '    if compression.baseline_hook != "none" and compression.baseline_bucket_cap_mb is not None:\n',
        '    if compression.baseline_bucket_cap_mb is not None:\n',
        "tests/test_buckets.py",
        "the cap meant for torch's PowerSGD (one bucket) also applies to raycomp's own hook",
    ),
    mutant(
        "buckets-below-ddps-first-bucket", "raycomp/buckets.py",
        "    return round(min(MAX_CAP_MB, max(MIN_CAP_MB, gradient_mb(model) / buckets)), 2)\n",
        "    return round(min(MAX_CAP_MB, gradient_mb(model) / buckets), 2)\n",
        "tests/test_buckets.py",
        "a small model gets buckets of a few kB: a collective round per layer",
    ),
    mutant(
        "buckets-not-given-to-ddp", "raycomp/train/loop.py",
        "            ddp_options = ddp_kwargs(c, model)\n",
        "            ddp_options = {}\n",
        "tests/test_train_job.py -k critical_policy_switches",
        "raycomp.train.prepare_model builds DDP with its default buckets, whatever compression.bucket_cap_mb says",
    ),
    mutant(
        "find-unused-not-given-to-ddp", "raycomp/train/loop.py",
        "                ddp_options[\"find_unused_parameters\"] = True\n",
        "                pass\n",
        "tests/test_train_job.py -k skips_parameters",
        "TrainOptions.find_unused_parameters never reaches DDP: a model that skips a head fails",
    ),
    mutant(
        "hook-counts-hidden-reductions", "raycomp/hook.py",
        "        if last or not state.overlaps:  # what backward, or the step after it, waited for\n",
        "        if True:\n",
        "tests/test_hook.py -k comm_time",
        "a reduction that ran beside backward counts as communication: overlap looks like a slow link",
    ),
    mutant(
        "hook-counts-only-inline-reductions", "raycomp/hook.py",
        "        if last or not state.overlaps:  # what backward, or the step after it, waited for\n",
        "        if not state.overlaps:\n",
        "tests/test_hook.py -k comm_time",
        "with the background thread no communication time is reported: every link looks free",
    ),
    mutant(
        "hook-decodes-before-next-send", "raycomp/hook.py",
        "                guarded(send, lambda pending: self._receiver.submit(finish, pending))  # type: ignore[union-attr]\n",
        "                guarded(send, finish)\n",
        "tests/test_hook.py",
        "the hook's sending thread also waits for and decodes each bucket: the next bucket is encoded only after this one left the wire",
    ),
    mutant(
        "gathered-mean-waits-before-returning", "raycomp/collectives.py",
        "    return gathering.then(average)\n",
        "    return Pending.done(gathering.then(average).wait())\n",
        "tests/test_hook.py",
        "the two-rank all-gather is waited for inside the sending thread: pipelining undone for int8/int4",
    ),
    mutant(
        "stats-grad-norm-of-compensated", "raycomp/stats.py",
        "             of_compensated if compensated is grad else norm(grad.float()),  # no residual: the same norm\n",
        "             of_compensated,\n",
        "tests/test_hook.py -k statistics_tell",
        "the statistics report the norm of gradient plus residual as the gradient's norm",
    ),
    mutant(
        "stats-error-relative-to-gradient", "raycomp/stats.py",
        "    error = error_norm / compensated_norm if compensated_norm > 0 else 0.0  # 0 when all was sent\n",
        "    error = error_norm / grad_norm if compensated_norm > 0 else 0.0  # 0 when all was sent\n",
        "tests/test_hook.py -k statistics_tell",
        "the compression error is measured against the gradient, not what was compressed (gradient plus residual)",
    ),
    mutant(
        "hook-never-sends-inline", "raycomp/hook.py",
        "        self._send_inline = self._sender is None or self._dense_everywhere()\n",
        "        self._send_inline = self._sender is None\n",
        "tests/test_hook.py -k issues_its_all_reduces",
        "a dense step still hands every bucket to the sending thread (CPU beside backward on a fast link)",
    ),
    mutant(
        "hook-sends-inline-if-any-layer-dense", "raycomp/hook.py",
        "            dense = all(self.transport_for(self.name_of(p), p.shape) is Transport.DENSE for p in self.parameters)\n",
        "            dense = any(self.transport_for(self.name_of(p), p.shape) is Transport.DENSE for p in self.parameters)\n",
        "tests/test_hook.py -k issues_its_all_reduces",
        "a plan with some dense layers issues from DDP's thread while compressed layers need the sending thread",
    ),
    mutant(
        "hook-shares-ddp-group", "raycomp/ddp.py",
        "        return dist.new_group(timeout=timeout_of(ddp_group or dist.group.WORLD))\n",
        "        return process_group\n",
        "tests/test_hook.py -k collide",
        "the hook's collectives share DDP's group: DDP's used-parameter all-reduce races the last bucket's",
        timeout_s=300,
    ),
    mutant(
        "unused-layer-residual-spent", "raycomp/reducer.py",
        "                self.memory.update(name, compensated, torch.zeros_like(sent), False)\n",
        "                self.memory.update(name, compensated, sent, sparse)\n",
        "tests/test_hook.py -k keeps_its_error",
        "a layer no rank used loses from its residual what was sent, though DDP dropped that mean",
    ),
    mutant(
        "unused-layer-needs-every-rank", "raycomp/hook.py",
        "                self.settle_unused(lambda name: counts[self._map_index[name]] > 0)\n",
        "                self.settle_unused(lambda name: counts[self._map_index[name]] >= self.group.size)\n",
        "tests/test_hook.py -k keeps_its_error",
        "a layer counts as used only if every rank used it: an idle rank keeps what it sent into the mean",
    ),
    mutant(
        "hook-never-defers-unused", "raycomp/hook.py",
        "        self.defer_unused = self._ddp_reducer is not None\n",
        "        self.defer_unused = False\n",
        "tests/test_hook.py -k keeps_its_error",
        "with find_unused_parameters the memory is updated at once, before DDP says whether anyone used the layer",
    ),
    mutant(
        "settle-queued-outside-backward", "raycomp/hook.py",
        "        try:\n            engine.queue_callback(lambda: engine.queue_callback(settle))\n"
        "        except RuntimeError:  # not in a backward: DDP's join shadows a step of a joined rank\n"
        "            pass  # begin_step settles them as used\n",
        "        engine.queue_callback(lambda: engine.queue_callback(settle))\n",
        "tests/test_hook.py -k join",
        "a joined rank's shadow step (no backward) tries to queue the settling callback and fails",
    ),
    mutant(
        "held-updates-left-over", "raycomp/reducer.py",
        "        if self._unsettled:  # nothing settled the last step's (no backward ran it): as sent\n",
        "        if False:  # nothing settled the last step's (no backward ran it): as sent\n",
        "tests/test_hook.py -k held_back",
        "updates no callback settled stay held back: the next step compensates with a stale residual",
    ),
    mutant(
        "hook-group-default-timeout", "raycomp/ddp.py",
        "        return dist.new_group(timeout=timeout_of(ddp_group or dist.group.WORLD))\n",
        "        return dist.new_group()\n",
        "tests/test_hook.py -k within_the_process_group_timeout",
        "the hook's group gets gloo's 30-minute default: a rank that never arrives hangs the others that long",
        timeout_s=300,
    ),
    mutant(
        "hook-allows-ddp-group-with-unused-map", "raycomp/ddp.py",
        '    if process_group is ddp_group and getattr(model, "find_unused_parameters", False):\n',
        '    if process_group is ddp_group and getattr(model, "static_graph", False):\n',
        "tests/test_hook.py -k refused",
        "DDP's own group is accepted for the hook while DDP all-reduces its used-parameter map on it",
    ),
    mutant(
        "finite-flag-checks-dense-layers-only", "raycomp/reducer.py",
        "        finite = all_finite([grads[i] for t, members in routes.items() if t is not Transport.DENSE\n",
        "        finite = all_finite([grads[i] for t, members in routes.items() if t is Transport.DENSE\n",
        "tests/test_hook.py -k covers_compressed",
        "a compressed layer's NaN is not flagged: a compressor may drop it from the mean and the guard never skips the step",
    ),
    mutant(
        "memory-ignores-loss-scale", "raycomp/reducer.py",
        "            self.memory.rescale(factor)\n",
        "            pass\n",
        "tests/test_loss_scale.py -k bit_for_bit",
        "after a GradScaler growth or backoff the residual joins gradients at twice or half its weight",
    ),
    mutant(
        "server-residuals-ignore-loss-scale", "raycomp/reducer.py",
        "            self.scalable.rescale(factor)\n",
        "            pass\n",
        "tests/test_loss_scale.py -k int8",
        "the scalable transport's server residuals stay in the old scale's units",
    ),
    mutant(
        "dgc-velocity-ignores-loss-scale", "raycomp/memory.py",
        "        rescale([*self.velocity.values(), *self.accumulated.values()], factor)\n",
        "        rescale(self.accumulated.values(), factor)\n",
        "tests/test_loss_scale.py -k dgc",
        "DGC's momentum keeps the old scale's units while its accumulation follows the new one",
    ),
    mutant(
        "threshold-ignores-loss-scale", "raycomp/compressors/threshold.py",
        "        bar = self.threshold if self.loss_scale is None else self.threshold * self.loss_scale.to(flat.device)\n",
        "        bar = self.threshold\n",
        "tests/test_loss_scale.py -k threshold",
        "under fp16 loss scaling the fixed threshold meets the scaled gradient: far more is sent",
    ),
    mutant(
        "compressors-not-told-the-loss-scale", "raycomp/reducer.py",
        "            compressors[-1].loss_scale = self.loss_scale.scale  # None without a GradScaler\n",
        "",
        "tests/test_loss_scale.py -k threshold",
        "the reducer never tells a compressor the loss scale: threshold compares with the scaled gradient",
    ),
    mutant(
        "dgc-clip-ignores-loss-scale", "raycomp/memory.py",
        "                limit = limit * self.loss_scale.to(g.device)\n",
        "                pass\n",
        "tests/test_loss_scale.py -k clipped",
        "under fp16 loss scaling DGC clips the scaled gradient at the unscaled norm: updates shrink by the scale",
    ),
    mutant(
        "memory-not-told-the-loss-scale", "raycomp/reducer.py",
        "        self.memory.loss_scale = self.loss_scale.scale  # None without a GradScaler\n",
        "",
        "tests/test_loss_scale.py -k clipped",
        "the reducer never tells the memory the loss scale: DGC's clipping meets the scaled gradient",
    ),
    mutant(
        "loss-scale-followed-from-the-scaler-tensor", "raycomp/loss_scale.py",
        "        self.scale = scale.clone()  # the scaler's update() changes its tensor in place\n",
        "        self.scale = scale  # the scaler's update() changes its tensor in place\n",
        "tests/test_loss_scale.py -k topk",
        "the follower keeps the scaler's own tensor, which update() changes in place: the factor is always 1",
    ),
    mutant(
        "stats-in-scaled-units", "raycomp/stats.py",
        "        grad_norm=grad_norm / unscale,\n",
        "        grad_norm=grad_norm,\n",
        "tests/test_loss_scale.py -k topk",
        "the controller sees a gradient norm that doubles when the loss scale grows (a false critical regime)",
    ),
    mutant(
        "loss-scale-not-checkpointed", "raycomp/reducer.py",
        '        self.loss_scale.load_state_dict(state.get("loss_scale", {"scale": None}))\n',
        "",
        "tests/test_loss_scale.py -k resumed",
        "a resumed run does not know which scale its memory was saved in: the first change after it is missed",
    ),
    mutant(
        "scaler-overflow-falls-back", "raycomp/train/guard_step.py",
        "        if nonfinite and self.grad_scaler is not None and self.grad_scaler.get_scale() > 1.0:\n",
        "        if False:\n",
        "tests/test_train_loss_scale.py -k resumes",
        "every GradScaler overflow (routine in fp16) makes the guard fall back to dense for stable_steps steps",
        timeout_s=300,
    ),
    mutant(
        "guard-judges-scaled-gradients", "raycomp/train/loop.py",
        "            unscale_once(self.grad_scaler, self.optimizer)\n",
        "            pass\n",
        "tests/test_train_loss_scale.py -k resumes",
        "the guard's explosion test sees gradients times the loss scale, and the optimizer steps with them",
        timeout_s=300,
    ),
    mutant(
        "scaler-never-updated", "raycomp/train/loop.py",
        "            self.grad_scaler.update()  # backs off after an overflow, grows after clean steps\n",
        "            pass\n",
        "tests/test_train_loss_scale.py -k resumes",
        "the scale never backs off: an overflowing scale overflows every step and no step applies",
        timeout_s=300,
    ),
    mutant(
        "scaler-not-restored", "raycomp/train/loop.py",
        "                    self.grad_scaler.load_state_dict(own[\"grad_scaler\"])\n",
        "                    pass\n",
        "tests/test_train_loss_scale.py -k resumes",
        "a restarted worker starts a fresh scaler: it overflows again from the initial scale",
        timeout_s=300,
    ),
    mutant(
        "train-memory-ignores-scaler", "raycomp/train/loop.py",
        "                                          grad_scaler=self.grad_scaler)\n",
        "                                          grad_scaler=None)\n",
        "tests/test_train_loss_scale.py -k resumes",
        "raycomp.train's hook is not told the scaler: the memory mixes scales, the controller gets scaled norms",
        timeout_s=300,
    ),
    mutant(
        "scaler-unscaled-twice", "raycomp/loss_scale.py",
        "    if grad_scaler._per_optimizer_states[id(optimizer)][\"stage\"] is not OptState.UNSCALED:\n",
        "    if True:\n",
        "tests/test_train_loss_scale.py -k resumes",
        "a caller who unscaled to clip (torch's recipe) gets a RuntimeError from the second unscale_",
        timeout_s=300,
    ),
    mutant(
        "checkpoint-without-held-updates", "raycomp/reducer.py",
        "        if self._unsettled:  # held back by a step no backward closed: as sent, as the next step would\n",
        "        if False:  # held back by a step no backward closed: as sent, as the next step would\n",
        "tests/test_hook.py -k checkpoint_between_steps",
        "a joined rank checkpointed between a shadow step and its next step saves its memory without the update",
    ),
    mutant(
        "job-autocast-never-enabled", "jobs/train.py",
        "        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None)\n",
        "        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=False)\n",
        "tests/test_train_loss_scale.py -k its_precision",
        "workload.precision=bf16/fp16 trains in fp32: the setting is accepted and ignored",
    ),
    mutant(
        "job-fp16-scaler-not-given", "jobs/train.py",
        "    model = raycomp.train.prepare_model(workload.model, optimizer, scheduler, grad_scaler=precision.scaler,\n",
        "    model = raycomp.train.prepare_model(workload.model, optimizer, scheduler, grad_scaler=None,\n",
        "tests/test_train_loss_scale.py -k in_fp16",
        "the job scales the loss but raycomp.train never unscales: the optimizer steps with gradients x 65536",
        timeout_s=300,
    ),
    mutant(
        "controller-accepts-bad-loss-scale", "raycomp/messages.py",
        "            if data[\"loss_scale\"] <= 0:\n",
        "            if False:\n",
        "tests/test_controller.py -k malformed",
        "a report with a zero or negative loss scale is accepted and exported",
    ),
    mutant(
        "loss-scale-not-reported", "raycomp/train/loop.py",
        "        scale = None if self.grad_scaler is None else self.grad_scaler.get_scale()\n",
        "        scale = None\n",
        "tests/test_observability.py -k real_run",
        "an fp16 run's loss scale never reaches the controller: the dashboard's loss-scale panel stays empty",
        timeout_s=300,
    ),
    mutant(
        "skipped-steps-not-exported", "controllers/exporter.py",
        "        f[\"raycomp_skipped_steps_total\"].add_metric([rid], run.skipped_steps)\n",
        "        f[\"raycomp_skipped_steps_total\"].add_metric([rid], 0)\n",
        "tests/test_observability.py -k real_run",
        "the skipped-steps counter stays at 0 whatever the guard or the scaler skipped",
        timeout_s=300,
    ),
)


def repo_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=repo, check=True, capture_output=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (repo / f).is_file()]


def copy_repo(repo: Path, files: list[str], dest: Path) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, target)


def snippet_problems(m: Mutant, root: Path) -> list[str]:
    """Why the mutant cannot be applied under ``root`` (empty: it can)."""
    path = root / m.file
    if not path.is_file():
        return [f"{m.file} does not exist"]
    text = path.read_text()
    problems = []
    for original, replacement in m.edits:
        count = text.count(original)
        at = text.find(original)
        # an indented snippet must start a line: found inside a deeper-indented one (the code
        # moved into a nested block), the replacement would break the indentation
        inside = count == 1 and original[:1] in " \t" and at > 0 and text[at - 1] != "\n"
        if count != 1 or inside:
            first = original.strip().splitlines()[0]
            found = "only inside a more indented line" if inside else f"{count} times (expected once)"
            problems.append(f"{m.file}: snippet {first!r} found {found}")
        else:
            text = text.replace(original, replacement)
    return problems


def apply(m: Mutant, root: Path) -> None:
    path = root / m.file
    text = path.read_text()
    for original, replacement in m.edits:
        text = text.replace(original, replacement)
    path.write_text(text)


def missing_test_files(m: Mutant, root: Path) -> list[str]:
    paths = [a.split("::")[0] for i, a in enumerate(m.tests)
             if not a.startswith("-") and (i == 0 or m.tests[i - 1] not in ("-k", "-m"))]
    return [p for p in paths if not (root / p).exists()]


@dataclass
class Outcome:
    mutant: Mutant
    status: str
    seconds: float
    detail: str = ""


def run_selection(tests: tuple[str, ...], root: Path, timeout_s: int, log: Path) -> tuple[int | None, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the whole session: pytest, its gloo children, Ray
            proc.wait()
            rc = None
    tail = log.read_text().strip().splitlines()
    return rc, tail[-1] if tail else ""


def run_mutant(m: Mutant, repo: Path, files: list[str], log_dir: Path, keep: bool,
               baseline: bool) -> Outcome:
    started = time.monotonic()
    problems = snippet_problems(m, repo)
    if problems:
        return Outcome(m, "STALE", 0.0, "; ".join(problems))
    root = Path(tempfile.mkdtemp(prefix=f"raycomp-mutant-{m.name}-"))
    try:
        copy_repo(repo, files, root)
        missing = missing_test_files(m, root)
        if missing:
            return Outcome(m, "ERROR", time.monotonic() - started,
                           f"test files not in the repository: {', '.join(missing)}")
        if baseline:
            rc, tail = run_selection(m.tests, root, m.timeout_s, log_dir / f"{m.name}.baseline.log")
            if rc != 0:
                return Outcome(m, "ERROR", time.monotonic() - started,
                               f"the selection fails without the mutant (rc {rc}): {tail}")
        apply(m, root)
        rc, tail = run_selection(m.tests, root, m.timeout_s, log_dir / f"{m.name}.log")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.monotonic() - started
    if rc is None:
        return Outcome(m, "KILLED", seconds, f"timed out after {m.timeout_s} s")
    if rc == 1:
        return Outcome(m, "KILLED", seconds, tail)
    if rc == 0:
        return Outcome(m, "SURVIVED", seconds, tail)
    return Outcome(m, "ERROR", seconds, f"pytest exit status {rc}: {tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and whether each applies")
    parser.add_argument("--baseline", action="store_true",
                        help="run each selection unmutated first (it must pass)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies")
    parser.add_argument("--log-dir", type=Path, help="where pytest output goes (default: a temp dir)")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        parser.error("duplicate mutant names")
    selected = list(MUTANTS)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown mutant {unknown[0]!r}; known: {', '.join(names)}")
        selected = [m for m in MUTANTS if m.name in args.only]

    if args.list:
        for m in selected:
            problems = snippet_problems(m, REPO)
            state = "STALE: " + "; ".join(problems) if problems else "applies"
            print(f"{m.name:<42} {m.file:<38} {' '.join(m.tests):<55} {state}")
            print(f"{'':<42} {m.why}")
        return 1 if any(snippet_problems(m, REPO) for m in selected) else 0

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="raycomp-mutants-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    files = repo_files(REPO)
    print(f"{len(selected)} mutants; copies of {len(files)} files; pytest logs in {log_dir}", flush=True)
    outcomes = []
    started = time.monotonic()
    for m in selected:
        outcome = run_mutant(m, REPO, files, log_dir, args.keep, args.baseline)
        outcomes.append(outcome)
        print(f"{outcome.status:<9} {outcome.seconds:7.1f} s  {m.name:<42} {' '.join(m.tests)}", flush=True)
        if outcome.status != "KILLED" or outcome.detail.startswith("timed out"):
            print(f"{'':<20}{outcome.detail}", flush=True)
        if outcome.status == "STALE":
            print(f"{'':<20}!!! STALE MUTANT {m.name}: the code it targets moved; re-point its snippet "
                  f"in tests/mutants.py !!!", flush=True)
    total = time.monotonic() - started
    counts = {s: sum(o.status == s for o in outcomes) for s in ("KILLED", "SURVIVED", "STALE", "ERROR")}
    print(f"\n{', '.join(f'{n} {s.lower()}' for s, n in counts.items())} in {total:.0f} s")
    return 0 if counts["KILLED"] == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
