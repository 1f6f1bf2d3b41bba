"""megatron-core's kernel fuser (torch.compile) is off in job programs on a machine without a
GPU, so their import leaves TorchDynamo and Inductor out; LAUNCHER_KEEP_JIT_FUSER=1 keeps it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import json, sys
import launcher_scripts.jobs
from megatron.core import jit
from megatron.core.fusions import fused_bias_dropout  # decorated with the fuser at import
from megatron.core.models.gpt import GPTModel
print(json.dumps({
    "fuser": jit.jit_fuser.__name__,
    "compiler_imported": "torch._dynamo" in sys.modules or "torch._inductor" in sys.modules,
}))
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

    if torch.cuda.is_available():
        assert probe() == {"fuser": "compile", "compiler_imported": True}
    else:
        assert probe() == {"fuser": "noop_decorator", "compiler_imported": False}


def test_the_switch_keeps_megatrons_fuser() -> None:
    found = probe(LAUNCHER_KEEP_JIT_FUSER="1")
    assert found["fuser"] == "compile" and found["compiler_imported"]
