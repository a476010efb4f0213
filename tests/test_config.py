"""Bad configs and CLI invocations fail before any Ray resource is taken, with exit code 2
and one line naming the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jobs.config import ConfigError, load_config
from jobs.train import prepare
from tests.support.repo import REPO

DIGITS = str(REPO / "jobs" / "configs" / "digits.yaml")

BAD = [
    (["compression.policy=magic"], r"compression.policy: must be one of 'static'.*got 'magic'"),
    (["controller.interval_steps=-1"], r"controller.interval_steps: .*greater than or equal to 1"),
    (["compression.static.compressor={name: topk, ratio: 1.5}"], r"compression.static.compressor: ratio: must be in \(0, 1\]"),
    (["compression.static.compressor={name: zip}"], r"compressor: unknown name 'zip'; allowed: .*topk"),
    (["compression.static.compressor={name: topk, rank: 2}"], r"unknown parameter 'rank'; allowed: ratio"),
    (["scaling.num_workers=0"], r"scaling.num_workers: .*greater than or equal to 1"),
    (["workload.epochs=abc"], r"workload.epochs: .*valid integer"),
    (["compression.colour=red"], r"compression.colour: unknown key"),
    (["workload.name=mnist"], r"workload.name: must be one of 'digits', 'fashion_mnist' or 'kjv'"),
    (["workload.name=fashion_mnist", "workload.data_dir=/nonexistent"], r"workload.data_dir: no Fashion-MNIST in '/nonexistent'; install the Debian package 'dataset-fashion-mnist'"),
    (["compression.memory=dgc"], r"compression.memory: 'dgc' applies momentum itself; set workload.momentum=0"),
    (["controller.metrics_port=70000"], r"controller.metrics_port: .*less than or equal to 65535"),
    (["workload.lr=0"], r"workload.lr: .*greater than 0"),
    (["compression.schedule.stages=[]"], r"compression.schedule.stages: at least one stage is required"),
    (["notakeyvalue"], r"override 'notakeyvalue': expected key.path=value"),
    (["compression.policy=[unclosed"], r"override 'compression.policy=\[unclosed': value is not valid YAML"),
    (["run.name=has space"], r"run.name: String should match pattern"),
    (["compression.bucket_cap_mb=0"], r"compression.bucket_cap_mb: must be 'auto' or a size in MB in \(0, 100000\], got 0$"),
    (["compression.bucket_cap_mb=big"], r"compression.bucket_cap_mb: must be 'auto' or a size in MB .*got 'big'$"),
    (["faults.nan_rank=1"], r"^faults: unknown key$"),  # a fault drill's section only (jobs.faults)
    (["benchmark.baseline=torch_fsdp"], r"^benchmark.baseline: 'torch_fsdp' needs scaling.strategy=fsdp$"),
    (["benchmark.baseline=torch_powersgd", "scaling.strategy=fsdp", "compression.policy=adaptive"],
     r"^benchmark.baseline: 'torch_powersgd' is a DDP hook; allowed with scaling.strategy=fsdp: none, "
     r"torch_fsdp, torch_fsdp_bf16, torch_hsdp$"),
    (["workload.precision=fp8"], r"workload.precision: must be one of 'fp32', 'bf16' or 'fp16'"),
    (["workload.precision=fp16", "scaling.strategy=fsdp", "compression.policy=static",
      "compression.static.compressor={name: int8}"],
     r"workload.precision: 'fp16' \(a loss scaler\) is not available with scaling.strategy=fsdp; allowed there: fp32, bf16$"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0][:40] for b in BAD])
def test_bad_config_is_rejected_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare(["--config", DIGITS, *overrides])


def test_local_mode_off_unquoted_is_the_word_yaml_reads_as_false():
    config, _, _ = prepare(["--config", DIGITS, "compression.local.mode=fixed", "compression.local.mode=off"])
    assert config.compression.local.mode == "off"
    config = load_config(REPO / "jobs/configs/digits.yaml", ["compression.local={mode: off, sync_every: 4}"])
    assert (config.compression.local.mode, config.compression.local.sync_every) == ("off", 4)
    # only False is taken for the word; YAML's other booleans are refused as before
    with pytest.raises(ConfigError, match=r"^compression.local.mode: must be one of 'off', 'fixed' or 'auto', got True$"):
        prepare(["--config", DIGITS, "compression.local.mode=on"])


def test_a_fault_drill_loads_the_faults_section():
    from jobs.faults import DrillConfig, FaultsSection

    config, _, _ = prepare(["--config", DIGITS, "faults.kill_rank_at_step=3", "faults.kill_rank=1"], DrillConfig)
    assert config.faults == FaultsSection(kill_rank_at_step=3, kill_rank=1)
    with pytest.raises(ConfigError, match=r"^faults.nan_rank must be < scaling.num_workers \(2\)$"):
        prepare(["--config", DIGITS, "faults.nan_rank=7"], DrillConfig)


def test_config_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*missing.yaml' does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping of sections"):
        load_config(listed)
    code = tmp_path / "code.yaml"  # YAML tags that would construct Python objects are refused
    code.write_text("run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(code)


def test_every_shipped_config_is_valid():
    for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")):
        if path.name.startswith("tune_"):
            continue  # search spaces, validated by jobs.tune
        load_config(path)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--config", DIGITS, "compression.policy=magic"], "compression.policy: must be one of"),
        (["--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml' does not exist"),
        (["--config", DIGITS, "--run-id", "bad/id"], "--run-id: only letters, digits"),
        (["--config", DIGITS, "--output", "/etc/hostname"], "--output: '/etc/hostname' exists and is not a directory"),
    ],
)
def test_cli_exits_2_with_one_line_before_touching_ray(argv, message):
    # an unreachable RAY_ADDRESS: had the job tried to connect, it would fail differently
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "jobs.train", *argv], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


def test_the_fault_drill_command_takes_the_faults_keys_and_exits_2_with_one_line():
    # python -m jobs.faults is jobs.train's command with DrillConfig: faults.* is a known key
    # there (its own check answers), and a bad one still fails before Ray is touched
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "jobs.faults", "--config", DIGITS, "faults.nan_rank=7"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: faults.nan_rank must be < scaling.num_workers (2)", done.stderr


def test_port_in_use_by_another_program_is_rejected():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"controller.metrics_port: {port} on 127.0.0.1 is in use by another program"):
            prepare(["--config", DIGITS, f"controller.metrics_port={port}"])


def test_unreadable_dataset_is_rejected(tmp_path):
    import gzip
    import shutil

    from jobs import data

    for name in data.FASHION_MNIST_FILES:
        shutil.copy(data.FASHION_MNIST_DIR / name, tmp_path / name)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"garbage"))
    with pytest.raises(ConfigError, match=r"workload.data_dir: t10k-labels-idx1-ubyte.gz is unreadable"):
        prepare(["--config", DIGITS, "workload.name=fashion_mnist", f"workload.data_dir={tmp_path}"])
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match=r"train-images-idx3-ubyte.gz is unreadable"):
        prepare(["--config", DIGITS, "workload.name=fashion_mnist", f"workload.data_dir={tmp_path}"])


# --- bad input that used to slip through to Ray (issue 11, item 5) -----------------------
# Each case runs the real command in a fresh interpreter with no RAY_ADDRESS (so the checks
# for an embedded cluster on this machine apply) and a private RAY_TMPDIR: had the command
# got as far as ray.init, a session directory would appear there.
BUSY = "{busy}"  # replaced by a port held open by this test process


def _cases(tmp: str) -> dict[str, tuple[str, list[str], str]]:
    """id -> (module, argv, what the one line must say)."""
    from jobs.config import local_cpus

    blocker = f"{tmp}/a-file"
    tune = ["--config", str(REPO / "jobs" / "configs" / "tune_digits.yaml")]
    return {
        "host-five-octets": ("jobs.train", ["controller.metrics_host=0.0.0.0.0"],
                             "controller.metrics_host: '0.0.0.0.0' is not a valid IPv4 address"),
        "host-octet-range": ("jobs.train", ["controller.metrics_host=256.1.1.1"],
                             "controller.metrics_host: '256.1.1.1' is not a valid IPv4 address"),
        "host-syntax": ("jobs.train", ["controller.metrics_host=bad_host!"],
                        "controller.metrics_host: must be an IPv4 or IPv6 address"),
        "host-brackets": ("jobs.train", ["controller.metrics_host='[::1]'"],
                          "controller.metrics_host: must be an IPv4 or IPv6 address"),
        "host-unresolvable": ("jobs.train", ["controller.metrics_host=no-such-host.invalid"],
                              "controller.metrics_host: cannot resolve 'no-such-host.invalid'"),
        "host-not-local": ("jobs.train", ["controller.metrics_host=192.0.2.1"],  # TEST-NET-1
                           "controller.metrics_host: cannot listen on '192.0.2.1' on this machine"),
        "port-in-use": ("jobs.train", [f"controller.metrics_port={BUSY}"],
                        f"controller.metrics_port: {BUSY} on 127.0.0.1 is in use by another program"),
        "storage-under-proc": ("jobs.train", ["run.storage_path=/proc/raycomp-test"],
                               "run.storage_path: '/proc/raycomp-test' is not a writable directory"),
        "storage-under-file": ("jobs.train", [f"run.storage_path={blocker}/runs"],
                               f"run.storage_path: cannot create '{blocker}/runs': '{blocker}' is not a directory"),
        "output-under-proc": ("jobs.train", ["--output", "/proc/raycomp-test/run"],
                              "--output: '/proc/raycomp-test/run' is not a writable directory"),
        "snapshot-under-proc": ("jobs.train", ["controller.snapshot_dir=/proc/raycomp-test"],
                                "controller.snapshot_dir: '/proc/raycomp-test' is not a writable directory"),
        "sd-file-under-proc": ("jobs.train", ["controller.metrics_sd_file=/proc/raycomp-test.json"],
                               "controller.metrics_sd_file: '/proc/raycomp-test.json' cannot be written"),
        "sd-file-is-dir": ("jobs.train", [f"controller.metrics_sd_file={tmp}"],
                           f"controller.metrics_sd_file: '{tmp}' is a directory"),
        "batch-exceeds-data": ("jobs.train", ["workload.batch_size=1000"],
                               "workload.batch_size: 1000 x 2 workers (scaling.num_workers) exceeds the 1438"),
        "workers-exceed-cpus": ("jobs.train", [f"scaling.num_workers={local_cpus() + 1}"],
                                f"scaling.num_workers: {local_cpus() + 1} workers x 1 CPU each"),
        "cpus-per-worker": ("jobs.train", ["scaling.num_workers=1", f"scaling.cpus_per_worker={local_cpus() + 0.5}"],
                            f"need {local_cpus() + 0.5:g} CPUs; this machine has {local_cpus()}"),
        "gpu-missing": ("jobs.train", ["scaling.num_workers=1", "scaling.use_gpu=true"],
                        "scaling.use_gpu: needs 1 GPUs (one per worker, scaling.num_workers); this machine has 0"),
        "kjv-block": ("jobs.train", ["workload.name=kjv", "workload.max_chars=10000", "workload.block=600"],
                      "workload.block: 600 is too long for the 500-character test split"),
        "tune-output-under-proc": ("jobs.tune", [*tune, "--output", "/proc/raycomp-test"],
                                   "--output: '/proc/raycomp-test/digits-schedules' is not a writable directory"),
        "tune-base-host": ("jobs.tune", [*tune, "base.overrides=[controller.metrics_host=0.0.0.0.0]"],
                           "base: controller.metrics_host: '0.0.0.0.0' is not a valid IPv4 address"),
        "tune-search-batch": ("jobs.tune", [*tune, "search={workload: {batch_size: {randint: [16, 2000]}}}"],
                              "search.workload.batch_size: 2000 is not a valid value (workload.batch_size: 2000 x 2"),
    }


def _skip_reason(case: str) -> str | None:
    import shutil

    import torch

    from jobs import data

    if case == "gpu-missing" and torch.cuda.is_available():
        return "this machine has a GPU"
    if case == "kjv-block" and shutil.which("bible") is None and not data.kjv_cache_file().is_file():
        return "kjv text not installed (Debian packages bible-kjv, bible-kjv-text)"
    return None


CASE_IDS = list(_cases("/tmp/x"))


@pytest.fixture(scope="module")
def slipped_inputs(request, tmp_path_factory):
    """Run every selected case: each is the real ``python -m`` command's ``main`` in a process
    of its own, forked from one interpreter that imported the commands once
    (tests/forked_cli.py: a fresh interpreter per case would import torch once each)."""
    import json
    import socket

    selected = {item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_bad_input_exits_2_with_one_line_before_ray_starts"}

    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "a-file").write_text("not a directory\n")
    results = {}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = str(holder.getsockname()[1])
        cases, expected = [], {}
        for case, (module, argv, message) in _cases(str(tmp)).items():
            if case not in selected or _skip_reason(case):
                continue
            ray_tmp = tmp / f"ray-{case}"
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=str(ray_tmp))
            argv = [a.replace(BUSY, busy) for a in argv]
            if module == "jobs.train":
                argv = ["--config", DIGITS, *argv]
            cases.append({"id": case, "module": module, "argv": argv, "env": env, "cwd": str(REPO)})
            expected[case] = (ray_tmp, message.replace(BUSY, busy))
        if cases:
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            env.update(PYTHONPATH=str(REPO))
            forked = subprocess.run([sys.executable, "-m", "tests.forked_cli"], input=json.dumps(cases),
                                    cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert forked.returncode == 0, forked.stderr[-3000:]
            for case, result in json.loads(forked.stdout).items():
                ray_tmp, message = expected[case]
                results[case] = (result["code"], result["stdout"], result["stderr"], ray_tmp, message)
    return results


@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_input_exits_2_with_one_line_before_ray_starts(slipped_inputs, case):
    if _skip_reason(case):
        pytest.skip(_skip_reason(case))
    code, out, err, ray_tmp, message = slipped_inputs[case]
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], (message, lines[0])
    assert "Started a local Ray instance" not in out + err
    sessions = list(ray_tmp.glob("session_*")) if ray_tmp.exists() else []
    assert not sessions, f"a Ray session was started: {sessions}"


def test_good_hosts_and_paths_pass(tmp_path):
    from raycomp.config import host_literal

    for host in ("127.0.0.1", "0.0.0.0", "::1", "::", "fe80::1%lo", "localhost", "node-1.example.com",
                 "example.com."):
        assert host_literal(host) == host
    for host in ("0.0.0.0.0", "1.2.3", "256.0.0.1", "-node", "a..b", "x" * 64, "[::1]", "host:9478", ""):
        with pytest.raises(ValueError):
            host_literal(host)
    storage = tmp_path / "deep" / "runs"
    config, _, output = prepare(["--config", DIGITS, "--run-id", "r1", f"run.storage_path={storage}",
                                 "controller.metrics_host=localhost", "controller.metrics_port=0",
                                 f"controller.snapshot_dir={tmp_path / 'snap'}",
                                 f"controller.metrics_sd_file={tmp_path / 'sd' / 'targets.json'}"])
    assert output == storage / "r1"
    assert not (tmp_path / "deep").exists() and not (tmp_path / "snap").exists() and not (tmp_path / "sd").exists()
    assert list(tmp_path.iterdir()) == [], "the writability probes left something behind"


def test_digits_size_matches_the_data():
    from jobs import data
    from jobs.config import DIGITS_TRAIN_EXAMPLES

    assert len(data.digits()[0]) == DIGITS_TRAIN_EXAMPLES
