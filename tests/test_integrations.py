"""What the framework integrations share, without a framework: the core imports none, the
options they cannot honour fail in one line, and a batch's size is found in any nesting.
(The integrations themselves: tests/test_lightning.py, tests/test_transformers.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.fake_loop import fake_loop
from tests.support.repo import REPO


def test_raycomp_its_train_api_the_controllers_and_the_jobs_import_no_framework():
    code = ("import sys\n"
            "for name in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate'):\n"
            "    sys.modules[name] = None  # importing it fails\n"
            "import raycomp, raycomp.train, raycomp.integrations, raycomp.integrations.framework_step\n"
            "import raycomp.integrations.state_files, raycomp.controllers.service, jobs.train, jobs.tune\n"
            "for glue in ('lightning', 'transformers'):\n"
            "    try:\n"
            "        __import__(f'raycomp.integrations.{glue}')\n"
            "    except ImportError:\n"
            "        print(f'{glue} glue needs {glue}')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["lightning glue needs lightning", "transformers glue needs transformers"]


@pytest.mark.parametrize("options, message", [
    ({"strategy": "fsdp"}, r"^strategy: the framework glue runs on the framework's DDP model; allowed: 'ddp', "
                           r"got 'fsdp'$"),
    ({"checkpoint": {"every_steps": 5}}, r"^checkpoint\.every_steps: the framework glue checkpoints through the "
                                         r"framework's own checkpoints .*allowed: None, got 5$"),
    ({"compression": {"lr_scaling": {"enabled": True}}}, r"^compression\.lr_scaling\.enabled: .*allowed: False$"),
])
def test_options_a_framework_driven_step_cannot_honour_are_refused_in_one_line(options, message):
    from raycomp.config import CheckpointSection, CompressionSection
    from raycomp.integrations.framework_step import refuse_unsupported
    from raycomp.train import TrainOptions

    built = TrainOptions(
        strategy=options.get("strategy", "ddp"),
        checkpoint=CheckpointSection(**options.get("checkpoint", {})),
        compression=CompressionSection(**options.get("compression", {})))
    with pytest.raises(ValueError, match=message):
        refuse_unsupported(built, "the framework glue")
    refuse_unsupported(TrainOptions(), "the framework glue")  # the defaults pass


def test_a_batch_size_is_the_first_dimension_of_its_first_tensor():
    from raycomp.integrations.framework_step import batch_size

    x, y = torch.zeros(7, 3), torch.zeros(7)
    assert batch_size(x) == 7
    assert batch_size((x, y)) == batch_size([x, y]) == 7
    assert batch_size({"input_ids": torch.zeros(5, 9), "labels": torch.zeros(5, 9)}) == 5
    assert batch_size({"meta": "text", "inputs": [torch.tensor(1.0), torch.zeros(4, 2)]}) == 4
    assert batch_size("text") == batch_size(torch.tensor(3.0)) == batch_size([]) == 0


def test_the_logged_values_are_the_run_s_ratio_plan_version_and_fallbacks():
    from raycomp.integrations.framework_step import LOGGED, FrameworkStep

    logged = FrameworkStep(fake_loop()).logged()
    assert list(logged) == list(LOGGED)
    assert logged == {"raycomp/compression_ratio": 4.0, "raycomp/plan_version": 3,
                      "raycomp/fallback_active": 0.0, "raycomp/fallbacks": 1}
    assert isinstance(logged["raycomp/plan_version"], int)
    # no byte sent yet, or one worker: 1.0, as ray.train.report has it
    assert FrameworkStep(fake_loop(ratio=None, active=True)).logged()["raycomp/compression_ratio"] == 1.0
