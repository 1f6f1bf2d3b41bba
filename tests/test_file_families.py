"""A model file of another family than its reader's, and a LoRA file tuned on a base of another
family than the base given with it, are refused before anything runs, in one line naming the
file, its family and architecture and what the recipe expects; the fix names only shipped
recipes that take the file (families/file_family.py). Every stage that reads a whole model's
file, against every family's file; every reader of a LoRA file with a base, against every
other family's base."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import launcher_scripts.families  # noqa: F401  (the shape tables inspect_portable checks)
from launcher_scripts.families import FAMILIES
from launcher_scripts.families.file_family import peft_record
from launcher_scripts.formats.portable_check import inspect_portable
from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.tuning import PeftSettings
from tests.support import REPO
from tests.support.commands import ONE_THREAD, assert_one_line_error, run_main
from tests.support.conversion import convert
from tests.support.training import train, write_training_config

# The files come from trained models (the session's GPT and T5, a BERT trained here).
pytestmark = pytest.mark.slow

FILE_FAMILIES = ("gpt", "t5", "bert")
QKV = "decoder.layers.self_attention.linear_qkv.weight"

# (stage, recipe, the key naming the whole model's file, the recipe's family, what it does)
READERS = [
    ("evaluation", "gpt3/evaluate_all", "model.nemo_model", "gpt", "evaluates"),
    ("evaluation", "t5/squad", "model.restore_from_path", "t5", "evaluates"),
    ("evaluation", "mt5/xquad", "model.restore_from_path", "t5", "evaluates"),
    ("export", "gpt3/export_gpt3", "model.nemo_file", "gpt", "exports"),
    ("export", "t5/export_t5", "model.nemo_file", "t5", "exports"),
    ("export", "mt5/export_mt5", "model.nemo_file", "t5", "exports"),
    ("fine_tuning", "gpt3/squad", "model.restore_from_path", "gpt", "tunes"),
    ("fine_tuning", "t5/squad", "model.restore_from_path", "t5", "tunes"),
    ("peft", "gpt3/squad", "model.restore_from_path", "gpt", "tunes"),
    ("peft", "t5/squad", "model.restore_from_path", "t5", "tunes"),
    ("training", "gpt3/tiny", "model.restore_from_path", "gpt", "continues pretraining of"),
]
MISMATCHED = [
    pytest.param(*reader, held, id=f"{reader[0]}={reader[1]}-{held}-file")
    for reader in READERS
    for held in FILE_FAMILIES
    if held != reader[3]
]


@pytest.fixture(scope="module")
def bert_file(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bert/tiny trained two steps on one process and converted (no session fixture holds a
    BERT file)."""
    folder = tmp_path_factory.mktemp("bert")
    steps = (
        "training=bert/tiny",
        "training.model.micro_batch_size=2",
        "training.model.global_batch_size=4",
        "training.trainer.max_steps=2",
        "training.trainer.val_check_interval=2",
        "training.trainer.limit_val_batches=1",
    )
    train(write_training_config(prepared_wordpiece, folder / "run", *steps))
    return convert(
        prepared_wordpiece,
        folder / "run",
        folder / "converted",
        "conversion=bert/convert_bert",
        "conversion.run.hf_dir_name=null",
    )


@pytest.fixture(scope="module")
def model_files(tiny_portable: Path, t5_converted: Path, bert_file: Path) -> dict[str, Path]:
    t5 = t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"
    return {"gpt": tiny_portable, "t5": t5, "bert": bert_file}


@pytest.fixture(scope="module")
def lora_files(
    model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """A LoRA file for the GPT and the T5 model, written as the peft stage writes one (with
    what the tuning job records of its base): rank 2 on the second layer's QKV."""
    folder = tmp_path_factory.mktemp("lora")
    settings = PeftSettings(scheme="lora", rank=2, alpha=2.0, target_modules=("attention_qkv",))
    files = {}
    for name in ("gpt", "t5"):
        base = inspect_portable(model_files[name])
        _layers, rows, columns = base.shapes[QKV]
        stack = "decoder." if FAMILIES[name].encoder_decoder else ""  # T5's keys name the block
        key = f"decoder.layers.peft.{stack}2.attention_qkv"
        tensors = {
            f"{key}.lora_a": torch.full((2, columns), 0.01),
            f"{key}.lora_b": torch.full((rows, 2), 0.01),
        }
        files[name] = folder / f"{name}_lora.nemo"
        record = {"stage": "peft", **peft_record(base.config, model_files[name])}
        peft_file.write(files[name], settings, record, tensors)
    return files


def dry_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_main(
        *overrides,
        "dry_run=true",
        f"base_results_dir={tmp_path / 'results'}",
        f"data_dir={tmp_path / 'data'}",
    )


def merge_lora(base: Path, lora: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher_scripts", "merge-lora", str(base), str(lora), str(output)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=600,
    )


def assert_fix_names_only_recipes_taking(line: str, family: str) -> None:
    """Every `<group>=<recipe>` the line names is a shipped recipe that takes a file of
    `family`: one of that family, or conversion=hf_export (any family with an export)."""
    named = re.findall(r"\b(\w+)=([\w/]+)", line)
    assert named, line
    for group, recipe in named:
        path = REPO / "conf" / group / f"{recipe}.yaml"
        assert path.is_file(), (group, recipe, line)
        shipped = yaml.safe_load(path.read_text())
        if (group, recipe) == ("conversion", "hf_export"):
            assert FAMILIES[family].hf_architecture is not None, line
        else:
            assert shipped.get("model_family", "gpt") == family, (group, recipe, line)


@pytest.mark.parametrize(("stage", "recipe", "key", "family", "does", "held"), MISMATCHED)
def test_a_model_file_of_another_family_is_refused_before_anything_runs(
    model_files: dict[str, Path],
    tmp_path: Path,
    stage: str,
    recipe: str,
    key: str,
    family: str,
    does: str,
    held: str,
) -> None:
    model_file = model_files[held]
    plus = "+" if stage == "training" else ""  # continued pretraining's key is optional
    result = dry_run(
        tmp_path, f"stages=[{stage}]", f"{stage}={recipe}", f"{plus}{stage}.{key}={model_file}"
    )
    assert_one_line_error(
        result,
        f"{stage}.{key}",
        str(model_file),
        f"holds a {held} model (",
        f"this recipe {does} {family} ones",
    )
    line = result.stderr.strip()
    architecture = re.search(rf"a {held} model \((\w+)\)", line)
    assert architecture is not None and architecture.group(1), line
    assert_fix_names_only_recipes_taking(line, held)
    assert not (tmp_path / "results").exists()


# (reader, its LoRA file's family, the base's family): every reader of a LoRA file with a base,
# every pair of differing families (a PEFT evaluation recipe of the base's family; BERT has
# none: its base is refused by the check above).
PAIRS = [
    pytest.param(reader, tuned_on, base, id=f"{reader}-{tuned_on}-lora-{base}-base")
    for reader in ("evaluation", "hf_export", "merge-lora")
    for tuned_on in ("gpt", "t5")
    for base in FILE_FAMILIES
    if base != tuned_on and not (reader == "evaluation" and base == "bert")
]
PEFT_EVALUATION = {"gpt": "peft_gpt3/squad", "t5": "peft_t5/squad"}


def pair_command(
    reader: str, lora: Path, base: Path, base_family: str, tmp_path: Path
) -> subprocess.CompletedProcess:
    if reader == "merge-lora":
        return merge_lora(base, lora, tmp_path / "merged.nemo")
    if reader == "hf_export":
        return dry_run(
            tmp_path,
            "stages=[conversion]",
            "conversion=hf_export",
            "conversion.run.model_train_name=tuned",
            f"conversion.nemo_file={base}",
            f"conversion.peft_file={lora}",
        )
    return dry_run(
        tmp_path,
        "stages=[evaluation]",
        f"evaluation={PEFT_EVALUATION[base_family]}",
        f"evaluation.model.language_model_path={base}",
        f"evaluation.model.peft_model_file={lora}",
    )


@pytest.mark.parametrize(("reader", "tuned_on", "base_family"), PAIRS)
def test_a_lora_file_with_a_base_of_another_family_is_refused_in_one_line(
    model_files: dict[str, Path],
    lora_files: dict[str, Path],
    tmp_path: Path,
    reader: str,
    tuned_on: str,
    base_family: str,
) -> None:
    lora, base = lora_files[tuned_on], model_files[base_family]
    result = pair_command(reader, lora, base, base_family, tmp_path)
    assert_one_line_error(
        result,
        str(lora),
        f"was tuned on a {tuned_on} model (",
        f"the base {base} holds a {base_family} model (",
        f"Give the {tuned_on} base it was tuned on ({model_files[tuned_on]})",
    )
    assert not (tmp_path / "merged.nemo").exists()
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_a_lora_file_with_its_own_base_still_merges(
    model_files: dict[str, Path], lora_files: dict[str, Path], tmp_path: Path, family: str
) -> None:
    result = merge_lora(model_files[family], lora_files[family], tmp_path / "merged.nemo")
    assert result.returncode == 0, result.stderr
    assert inspect_portable(tmp_path / "merged.nemo").config.model_family == family


def test_a_lora_layer_the_base_lacks_is_one_line(
    model_files: dict[str, Path], tmp_path: Path
) -> None:
    """A LoRA file of the base's family tuned on a deeper model: the layer it adapts is named,
    not an IndexError."""
    base = model_files["gpt"]
    layers, rows, columns = inspect_portable(base).shapes[QKV]
    key = f"decoder.layers.peft.{layers + 1}.attention_qkv"
    lora = tmp_path / "deeper_lora.nemo"
    settings = PeftSettings(scheme="lora", rank=2, alpha=2.0, target_modules=("attention_qkv",))
    tensors = {f"{key}.lora_a": torch.zeros(2, columns), f"{key}.lora_b": torch.zeros(rows, 2)}
    record = {"stage": "peft", **peft_record(inspect_portable(base).config, base)}
    peft_file.write(lora, settings, record, tensors)
    result = merge_lora(base, lora, tmp_path / "merged.nemo")
    assert_one_line_error(result, f"adapts layer {layers + 1}", f"has {layers} layers")
    assert not (tmp_path / "merged.nemo").exists()
