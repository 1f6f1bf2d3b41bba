"""The export's vLLM repository (jobs/export/vllm_repository.py): rendered from the Hugging Face
directory the conversion stage writes, its model.json keys vLLM's engine arguments, and bad
settings refused in one line before anything is written. Triton's vllm backend needs GPUs and
vLLM, which this machine lacks: the GPU suite is where it would run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.jobs.export.vllm_repository import ENGINE_ARGS, render_config
from tests.support.commands import assert_one_line_error, run_main


def export_with_vllm(default_run: Path, results: Path, *overrides: str) -> Any:
    """main.py's export of the default run's converted model, with the vLLM repository from
    its Hugging Face export."""
    converted = default_run / "results" / "gpt3_tiny" / "convert_nemo"
    assert (converted / "hf" / "config.json").is_file()
    return run_main(
        "stages=[export]",
        f"base_results_dir={results}",
        f"export.model.nemo_file={converted / 'megatron_gpt.nemo'}",
        "export.vllm.enabled=true",
        f"export.vllm.hf_dir={converted / 'hf'}",
        *overrides,
    )


def test_the_export_writes_a_vllm_repository_of_the_hf_export(
    default_run: Path, tmp_path: Path
) -> None:
    result = export_with_vllm(
        default_run,
        tmp_path,
        "export.vllm.max_model_len=128",
        "export.model.tensor_model_parallel_size=2",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "gpt3_tiny" / "export" / "model_repo_vllm" / "gpt3_tiny"
    assert (folder / "config.pbtxt").read_text() == render_config("gpt3_tiny")
    args = json.loads((folder / "1" / "model.json").read_text())
    assert set(args) <= ENGINE_ARGS
    hf = default_run / "results" / "gpt3_tiny" / "convert_nemo" / "hf"
    assert args["model"] == str(hf) and args["tensor_parallel_size"] == 2
    assert args["max_model_len"] == 128 and args["dtype"] == "auto"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("export.vllm.dtype=half", "export.vllm.dtype"),
        ("export.vllm.gpu_memory_utilization=1.5", "export.vllm.gpu_memory_utilization"),
        ("export.vllm.max_model_len=0", "export.vllm.max_model_len"),
        ("export.vllm.hf_dir=/nowhere/hf", "export.vllm.hf_dir"),
    ],
)
def test_bad_vllm_settings_are_one_line(
    default_run: Path, tmp_path: Path, override: str, key: str
) -> None:
    assert_one_line_error(export_with_vllm(default_run, tmp_path, override), key)
    assert not (tmp_path / "gpt3_tiny" / "export").exists()
