"""Benchmark references and the GPU check."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "torch-noop-all-reduces", "register_torch_hook",
        "        model.register_comm_hook(None, debugging_hooks.noop_hook)\n",
        "        model.register_comm_hook(None, default_hooks.allreduce_hook)\n",
        "tests/test_bench_e2e.py -k noop_hook",
        "the no-communication reference all-reduces: the step ratio's denominator includes the network",
    ),
    mutant(
        "bench-no-comm-one-seed-for-all", "analyze",
        "        m[\"step_vs_no_comm\"] = median([r[\"step_s\"] / no_comm[r[\"seed\"]] for r in m[\"runs\"]\n",
        "        m[\"step_vs_no_comm\"] = median([r[\"step_s\"] / no_comm[min(no_comm)] for r in m[\"runs\"]\n",
        "tests/test_bench_e2e.py -k documented_schema",
        "every seed's step is divided by the first seed's no-communication step, not its own group's",
    ),
    mutant(
        "bench-default-runs-every-h", "default_methods",
        "        local += [f\"{grid}_h{best[grid]}\"] if grid in best else variants\n",
        "        local += variants\n",
        "tests/test_bench_e2e.py -k default_run",
        "the default run ignores the workloads' best H and runs every H of every grid: about 2 h, not 81 min",
    ),
    mutant(
        "gpu-tests-miss-a-compressor", "tests/gpu/support.py:PARAMS",
        "    \"int4\": {\"chunk_size\": 2048},\n",
        "",
        "tests/test_device.py -k every_registered_compressor",
        "a registered compressor without parameters in the GPU tests: KeyError in every CUDA test it is in",
    ),
)
