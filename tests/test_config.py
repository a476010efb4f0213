"""Bad configs and CLI invocations fail before any Ray resource is taken, with exit code 2
and one line naming the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jobs.train import prepare
from raycomp.config import ConfigError, load_config
from tests.conftest import REPO

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
    (["faults.nan_rank=7"], r"faults.nan_rank must be < scaling.num_workers"),
    (["controller.metrics_port=70000"], r"controller.metrics_port: .*less than or equal to 65535"),
    (["workload.lr=0"], r"workload.lr: .*greater than 0"),
    (["compression.schedule.stages=[]"], r"compression.schedule.stages: at least one stage is required"),
    (["notakeyvalue"], r"override 'notakeyvalue': expected key.path=value"),
    (["compression.policy=[unclosed"], r"override 'compression.policy=\[unclosed': value is not valid YAML"),
    (["run.name=has space"], r"run.name: String should match pattern"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][0][:40] for b in BAD])
def test_bad_config_is_rejected_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare(["--config", DIGITS, *overrides])


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

    from raycomp import data

    for name in data.FASHION_MNIST_FILES:
        shutil.copy(data.FASHION_MNIST_DIR / name, tmp_path / name)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"garbage"))
    with pytest.raises(ConfigError, match=r"workload.data_dir: t10k-labels-idx1-ubyte.gz is unreadable"):
        prepare(["--config", DIGITS, "workload.name=fashion_mnist", f"workload.data_dir={tmp_path}"])
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match=r"train-images-idx3-ubyte.gz is unreadable"):
        prepare(["--config", DIGITS, "workload.name=fashion_mnist", f"workload.data_dir={tmp_path}"])
