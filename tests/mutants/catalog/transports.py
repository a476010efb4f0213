"""Transports: the collectives that carry each plan's payloads and their means."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "sparse-also-sends-dense", "sparse_allgather",
        "    gathering, overhead = gather_payloads(payloads, compressors, group)\n\n    def merge(",
        "    group.all_reduce_(torch.cat([t.detach().reshape(-1).float() for t in tensors]))\n"
        "    gathering, overhead = gather_payloads(payloads, compressors, group)\n\n    def merge(",
        "tests/test_wire.py tests/test_collectives.py",
        "the sparse all-gather path also all-reduces the dense tensor (wire grows, ledger unchanged)",
    ),
    mutant(
        "dense-mean-divided-twice", "dense_allreduce.finish",
        "            for i, mean in zip(members, split(buffer, [tensors[i] for i in members]), strict=True):\n",
        "            buffer.div_(group.size)\n"
        "            for i, mean in zip(members, split(buffer, [tensors[i] for i in members]), strict=True):\n",
        "tests/test_collectives.py",
        "dense all-reduce divides by the world size before and after summing",
    ),
    mutant(
        "summable-not-divided", "summable_allreduce",
        "    payloads = [c.compress(t / w) for t, c in zip(tensors, compressors, strict=True)]\n",
        "    payloads = [c.compress(t) for t, c in zip(tensors, compressors, strict=True)]\n",
        "tests/test_hook.py::test_lossless_settings_of_every_transport_give_ddps_mean",
        "casts/Random-K all-reduce the sum, not the mean",
    ),
    mutant(
        "dense-mean-left-in-a-copy", "dense_allreduce.finish",
        "                if in_place and mean.data_ptr() != t.data_ptr():\n",
        "                if False:\n",
        "tests/test_collectives.py -k land_in",
        "small dense layers between a bucket's compressed ones keep their means in a copy: the hook copies the whole bucket",
    ),
    mutant(
        "cast-decoded-into-a-new-buffer", "_cast_allreduce.finish",
        "        if in_place:  # the inputs (also what ``sent`` hands back) now hold the means\n",
        "        if False:  # the inputs (also what ``sent`` hands back) now hold the means\n",
        "tests/test_collectives.py -k land_in",
        "a bf16 bucket's means decoded into a new full-size buffer every step, then copied into the bucket",
    ),
    mutant(
        "cast-sum-not-divided", "_cast_allreduce",
        "        torch.div(region, w, out=wire)\n",
        "        wire.copy_(region)\n",
        "tests/test_hook.py::test_lossless_settings_of_every_transport_give_ddps_mean",
        "a bucket's bf16/fp16 layers (back to back) all-reduce the sum, not the mean",
    ),
    mutant(
        "cast-layers-sum-not-divided", "_cast_allreduce",
        "            torch.div(t, w, out=place)\n",
        "            place.copy_(t)\n",
        "tests/test_collectives.py -k land_in",
        "bf16/fp16 layers that do not lie back to back all-reduce the sum, not the mean",
    ),
    mutant(
        "cast-statistics-read-the-input", "_cast_allreduce",
        "        if keep_sent else list(tensors)\n",
        "        if False else list(tensors)\n",
        "tests/test_hook.py -k decodes_what",
        "a statistics step measures a cast as sent in full: its rounding error reads 0 and its layer as dense",
    ),
    mutant(
        "powersgd-no-orthogonalisation", "lowrank_allreduce",
        "        c.orthogonalize(p.reshape(ref.shape).clone())\n",
        "        p.reshape(ref.shape).clone()\n",
        "tests/test_hook.py::test_powersgd_recovers_an_exactly_low_rank_mean_across_ranks",
        "distributed PowerSGD skips the Gram-Schmidt step between its two all-reduces",
    ),
    mutant(
        "scalable-server-ef-removed", "ScalableAllreduce.__call__",
        "                    self.server_residuals[name] = average - back.float()\n",
        "                    pass\n",
        "tests/test_error_feedback.py",
        "the scalable all-reduce (sign/int8/QSGD) keeps no server-side error feedback",
    ),
    mutant(
        "two-ranks-take-two-rounds", "ScalableAllreduce.__call__",
        "        if w == 2 and self.gather_two_ranks:\n",
        "        if False:\n",
        "tests/test_collectives.py tests/test_wire.py",
        "at W = 2 the scalable all-reduce still takes two rounds and quantizes twice",
    ),
    mutant(
        "gathered-mean-drops-a-peer", "gathered_mean.average",
        "        for layers in by_rank[1:]:\n",
        "        for layers in by_rank[1:1]:\n",
        "tests/test_collectives.py",
        "the two-rank all-gather averages only the first rank's payload",
    ),
    mutant(
        "dense-bucket-always-copied", "dense_allreduce",
        "        lying = buffer_view([tensors[i] for i in members]) if in_place else None\n",
        "        lying = None\n",
        "tests/test_hook.py",
        "a dense DDP bucket is flattened into a new buffer every step instead of reduced where it lies",
    ),
    mutant(
        "gathered-mean-waits-before-returning", "gathered_mean",
        "    return gathering.then(average)\n",
        "    return Pending.done(gathering.then(average).wait())\n",
        "tests/test_hook.py",
        "the two-rank all-gather is waited for inside the sending thread: pipelining undone for int8/int4",
    ),
)
