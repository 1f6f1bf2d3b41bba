"""megatron-core's kernel fuser (torch.compile) is off in job programs on a machine without a
GPU, so their import leaves TorchDynamo and Inductor out; LAUNCHER_KEEP_JIT_FUSER=1 keeps it.
megatron-core's import leaves wandb, boto3 and fsspec out, and they import afterwards as usual."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO

PROBE = """
import json, sys
import launcher_scripts.jobs
from megatron.core import jit
from megatron.core.fusions import fused_bias_dropout  # decorated with the fuser at import
from megatron.core.models.gpt import GPTModel
from megatron.core.inference.contexts import dynamic_context
from launcher_scripts.jobs.training import trainer
found = {
    "fuser": jit.jit_fuser.__name__,
    "compiler_imported": "torch._dynamo" in sys.modules or "torch._inductor" in sys.modules,
    "wandb_imported": "wandb" in sys.modules,
    "boto3_imported": "boto3" in sys.modules,
    "fsspec_imported": "fsspec" in sys.modules,
    "megatron_has_wandb": dynamic_context.HAVE_WANDB,
}
import wandb
found["wandb_importable"] = callable(wandb.init)
import boto3
found["boto3_importable"] = callable(boto3.client)
import fsspec
found["fsspec_importable"] = callable(fsspec.filesystem)
print(json.dumps(found))
"""


def probe(**env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_fuser_is_off_only_without_a_gpu() -> None:
    import torch

    found = probe()
    if torch.cuda.is_available():
        assert (found["fuser"], found["compiler_imported"]) == ("compile", True)
    else:
        assert (found["fuser"], found["compiler_imported"]) == ("noop_decorator", False)


def test_megatrons_import_leaves_wandb_and_boto3_out_and_they_import_later() -> None:
    found = probe()
    assert not found["wandb_imported"] and not found["megatron_has_wandb"], found
    assert not found["boto3_imported"] and not found["fsspec_imported"], found
    assert found["wandb_importable"] and found["boto3_importable"], found
    assert found["fsspec_importable"], found


def test_the_switch_keeps_megatrons_fuser() -> None:
    found = probe(LAUNCHER_KEEP_JIT_FUSER="1")
    assert found["fuser"] == "compile" and found["compiler_imported"]
