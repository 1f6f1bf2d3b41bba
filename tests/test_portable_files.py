"""Damaged portable (.nemo) and PEFT files: every reader says what is wrong in one line, before
anything is loaded or written (portable_check), instead of a tar or safetensors traceback or a
model built from a config its weights do not fit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.jobs.fine_tuning.merge_lora import main as merge_lora_main
from launcher_scripts.tuning import PeftSettings
from tests.support import REPO
from tests.support.commands import run_main
from tests.support.damaged_files import damaged_tars, with_config

# model_config.yaml edits that the tiny model's weights contradict, and the tensor that says so.
DISAGREEING = {
    "num_layers": (2, "decoder.layers.self_attention.linear_qkv.weight"),
    "hidden_size": (256, "embedding.word_embeddings.weight"),
    "ffn_hidden_size": (1024, "decoder.layers.mlp.linear_fc1.weight"),
    "activation": ("swiglu", "decoder.layers.mlp.linear_fc1.weight"),
    "kv_channels": (16, "decoder.layers.self_attention.linear_qkv.weight"),
    "max_position_embeddings": (256, "embedding.position_embeddings.weight"),
}


@pytest.fixture(scope="module")
def broken(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Damaged copies of the tiny model's file, and ones whose config disagrees with it."""
    folder = tmp_path_factory.mktemp("broken")
    files = damaged_tars(tiny_portable, folder)
    for key, (value, _tensor) in DISAGREEING.items():
        files[f"config {key}"] = with_config(tiny_portable, folder / f"{key}.nemo", **{key: value})
    return files


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small LoRA file for the tiny model (hidden 128, QKV 384), written as the peft stage
    writes one."""
    path = tmp_path_factory.mktemp("lora") / "lora.nemo"
    settings = PeftSettings(scheme="lora", rank=2, alpha=2.0, target_modules=("attention_qkv",))
    tensors = {
        "peft.1.attention_qkv.lora_a": torch.full((2, 128), 0.01),
        "peft.1.attention_qkv.lora_b": torch.full((384, 2), 0.01),
    }
    peft_file.write(path, settings, {}, tensors)
    return path


def test_the_tiny_model_and_a_lora_file_pass(tiny_portable: Path, lora_file: Path) -> None:
    from launcher_scripts.formats import portable_check

    summary = portable_check.inspect_portable(tiny_portable)
    assert (
        summary.config.num_layers
        == summary.shapes["decoder.layers.self_attention.linear_qkv.weight"][0]
    )
    assert portable_check.inspect_peft(lora_file).config.peft.scheme == "lora"


def test_a_program_without_the_families_is_told_rather_than_left_unchecked(
    tiny_portable: Path,
) -> None:
    """The families register the tensor shapes a model file is checked against (the formats
    sit below them and do not import them): checking a file before they are imported is a bug
    in the program, named as one, not a file passed with its shapes unchecked."""
    program = "\n".join(
        [
            "import sys",
            "from launcher_scripts.formats.portable_check import inspect_portable",
            "inspect_portable(sys.argv[1])",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", program, str(tiny_portable)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 1, result.stderr
    assert "import launcher_scripts.families before checking a portable file" in result.stderr


def test_each_kind_of_damage_is_one_line(broken: dict[str, Path]) -> None:
    from launcher_scripts.formats import portable_check

    for kind, path in broken.items():
        with pytest.raises(portable_check.PortableFileError) as caught:
            portable_check.inspect_portable(path)
        message = str(caught.value)
        assert str(path) in message and "\n" not in message, (kind, message)
        if kind.startswith("config "):
            key = kind.removeprefix("config ")
            assert f"{DISAGREEING[key][1]} has shape" in message and key in message, message
        elif kind.startswith("cut"):
            assert "truncated" in message or "cut short" in message, (kind, message)


def assert_refused(result: subprocess.CompletedProcess, key: str, results: Path) -> None:
    """Exit 2, one line naming `key`, no traceback, nothing written."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}: "), result.stderr
    assert not results.exists()


# The tuning stages' sequences within the tiny model's 128 positions, so that only the file
# can be wrong.
STAGES = {
    "peft": (
        "stages=[peft] peft.model.data.train_ds.max_seq_length=128",
        "peft.model.restore_from_path",
    ),
    "fine_tuning": (
        "stages=[fine_tuning] fine_tuning.model.data.train_ds.max_seq_length=128",
        "fine_tuning.model.restore_from_path",
    ),
    "evaluation": ("stages=[evaluation]", "evaluation.model.nemo_model"),
    "evaluation of a PEFT model": (
        "stages=[evaluation] evaluation=peft_gpt3/squad",
        "evaluation.model.language_model_path",
    ),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("damage", ["cut in the weights", "garbage", "config num_layers"])
def test_preflight_refuses_a_damaged_base_model(
    broken: dict[str, Path], tmp_path: Path, stage: str, damage: str
) -> None:
    stages, key = STAGES[stage]
    result = run_main(
        *stages.split(),
        f"base_results_dir={tmp_path}/results",
        f"{key}={broken[damage]}",
        "dry_run=true",
    )
    assert_refused(result, key, tmp_path / "results")
    assert str(broken[damage]) in result.stderr


@pytest.mark.parametrize("damage", ["cut in the weights", "garbage"])
def test_preflight_refuses_a_damaged_peft_file(
    tiny_portable: Path, lora_file: Path, tmp_path: Path, damage: str
) -> None:
    peft = damaged_tars(lora_file, tmp_path / "peft")[damage]
    for stage, keys, extra in (
        ("evaluation=peft_gpt3/squad", ("language_model_path", "peft_model_file"), ()),
        (
            "peft",
            ("restore_from_path", "peft.restore_from_path"),
            ("peft.model.data.train_ds.max_seq_length=128",),  # the tiny model's positions
        ),
    ):
        name = stage.split("=")[0]
        base_key, peft_key = (f"{name}.model.{k}" for k in keys)
        result = run_main(
            f"stages=[{name}]",
            *([stage] if "=" in stage else []),
            *extra,
            f"base_results_dir={tmp_path}/results",
            f"{base_key}={tiny_portable}",
            f"{peft_key}={peft}",
            "dry_run=true",
        )
        assert_refused(result, peft_key, tmp_path / "results")


def merge_lora(base: Path, peft: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "merge-lora", str(base), str(peft), str(output)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_merge_lora_refuses_damaged_inputs_and_keeps_its_output(
    tiny_portable: Path,
    lora_file: Path,
    broken: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    output = tmp_path / "merged.nemo"
    assert merge_lora(tiny_portable, lora_file, output).returncode == 0  # the inputs are good
    before = output.read_bytes()
    peft = damaged_tars(lora_file, tmp_path / "peft")
    cases = [
        *((tiny_portable, peft[kind]) for kind in ("cut in the weights", "garbage", "empty")),
        *((broken[kind], lora_file) for kind in ("cut in the weights", "garbage", "no weights")),
        (broken["config num_layers"], lora_file),
        (broken["config hidden_size"], lora_file),
    ]
    for index, (base, lora) in enumerate(cases):
        # The first refusal as a user meets it, in a process of its own (nothing else on its
        # stderr); the others through the same main() in this process, sparing a torch start
        # each.
        if index == 0:
            result = merge_lora(base, lora, output)
            code, stderr = result.returncode, result.stderr
        else:
            code = merge_lora_main([str(base), str(lora), str(output)])
            stderr = capsys.readouterr().err
        assert code == 2, (base, lora, stderr)
        assert "Traceback" not in stderr, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr
        assert str(base if base != tiny_portable else lora) in lines[0]
        assert output.read_bytes() == before  # the earlier merge is untouched
