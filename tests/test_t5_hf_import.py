"""Importing a Hugging Face T5 (v1.0 and v1.1) and mT5 directory: tiny random models that
transformers itself builds and saves (tests/scripts/make_hf_t5.py, no hub), imported through
`python3 main.py conversion=hf_import`. After import our logits equal transformers' to 1e-4 in
fp32 and greedy answers are the same tokens; written back as a Hugging Face directory the
tensors are the original ones exactly, and the tokenizer encodes as before; the imported model
fine-tunes; what cannot be imported is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.commands import one_error_line, run_main, run_module
from tests.support.conversion import hf_imported

VARIANTS = ["t5_v1", "t5_v1.1", "mt5"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_t5") / "models"
    run_module("tests.scripts.make_hf_t5", str(folder))
    return folder


@pytest.fixture(scope="module")
def imported(hf_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every variant imported through main.py once: the portable files the tests read (the
    fine-tuning starts from t5_v1's rather than importing it again)."""
    results = tmp_path_factory.mktemp("imported")
    return {variant: hf_imported(hf_models / variant, results) for variant in VARIANTS}


@pytest.fixture(scope="module")
def checked(
    hf_models: Path, imported: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict, Path]]:
    """tests/scripts/hf_t5_check.py on every variant in one process (one start-up of torch,
    megatron-core and transformers for the three): each variant's report and export dir."""
    folder = tmp_path_factory.mktemp("back")
    cases = [(imported[v], hf_models / v, folder / v) for v in VARIANTS]
    output = run_module("tests.scripts.hf_t5_check", *(str(a) for case in cases for a in case))
    reports = [json.loads(line) for line in output.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(VARIANTS), output.stdout[-3000:]
    return {v: (report, folder / v) for v, report in zip(VARIANTS, reports, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_an_imported_t5_computes_what_transformers_does_and_exports_back_exactly(
    variant: str, checked: dict[str, tuple[dict, Path]]
) -> None:
    check, back_dir = checked[variant]
    assert check["logits"] <= 1e-4, check
    ours, theirs = check["greedy"]
    assert ours == theirs and all(len(answer) > 1 for answer in ours), check
    assert check["keys_equal"] and check["tensors_equal"], check
    assert check["token_ids"], check
    expected = "MT5ForConditionalGeneration" if variant == "mt5" else "T5ForConditionalGeneration"
    assert check["class"] == expected
    back = json.loads((back_dir / "config.json").read_text())
    assert back["architectures"] == [expected]


@pytest.mark.slow
def test_an_imported_t5_fine_tunes_and_exports_back(
    imported: dict[str, Path], tmp_path: Path
) -> None:
    """T5's decoder starts at id 0, the padding id: the masks must still attend to it. T5
    v1.0's output layer is the embedding table, with no bias: the tuned model exports."""
    from tests.support.sft_task import write_text_to_text_task

    model = imported["t5_v1"]  # the module's import, read only
    task = write_text_to_text_task(tmp_path / "task")
    (train_src, train_tgt), (val_src, val_tgt) = task["train"], task["val"]
    stage = "fine_tuning"
    result = run_main(
        f"stages=[{stage}]",
        f"{stage}=t5/custom_task",
        f"base_results_dir={tmp_path / 'results'}",
        f"{stage}.run.model_train_name=imported",
        f"{stage}.model.restore_from_path={model}",
        f"{stage}.model.data.train_ds.src_file_name={train_src}",
        f"{stage}.model.data.train_ds.tgt_file_name={train_tgt}",
        f"{stage}.model.data.validation_ds.src_file_name={val_src}",
        f"{stage}.model.data.validation_ds.tgt_file_name={val_tgt}",
        f"{stage}.model.data.train_ds.max_src_seq_length=32",
        f"{stage}.model.data.train_ds.max_tgt_seq_length=4",
        f"{stage}.trainer.accelerator=cpu",
        f"{stage}.trainer.precision=32",
        f"{stage}.trainer.devices=1",
        f"{stage}.trainer.max_steps=30",
        f"{stage}.trainer.val_check_interval=30",
        f"{stage}.model.global_batch_size=8",
        f"{stage}.model.micro_batch_size=4",
        f"{stage}.model.optim.lr=2e-3",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = tmp_path / "results" / "imported" / "custom_task" / "results" / "metrics.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [step for step, _ in losses] == [0, 30], losses
    assert losses[1][1] < 0.3 * losses[0][1], losses
    matches = [
        r["validation_exact_string_match"] for r in rows if "validation_exact_string_match" in r
    ]
    assert matches[-1] == 1.0, matches
    tuned = log.parent / "checkpoints" / "megatron_t5_custom_task.nemo"
    # tests/scripts/hf_export.py's export, in this process: it only reads the file and writes
    # the directory (torch is loaded here already; a process of its own was a start-up more).
    from tests.scripts.hf_export import export

    export(tuned, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"]


def test_what_cannot_be_imported_is_one_line(hf_models: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    base = ["stages=[conversion]", "conversion=hf_import", f"base_results_dir={results}"]
    one_error_line(
        run_main(*base, f"conversion.hf_model_dir={tmp_path / 'nowhere'}"),
        "conversion.hf_model_dir",
        "no readable config.json",
    )
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    one_error_line(
        run_main(*base, f"conversion.hf_model_dir={other}"),
        "conversion.hf_model_dir",
        "model_type 'bert' is not one this version imports",
        "mt5, qwen2",
    )
    odd = tmp_path / "odd"
    odd.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (odd / name).symlink_to(hf_models / "t5_v1.1" / name)
    config = json.loads((hf_models / "t5_v1.1" / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | {"feed_forward_proj": "gated-softplus"}))
    result = run_main(*base, f"conversion.hf_model_dir={odd}")
    assert result.returncode != 0
    log = "".join(p.read_text() for p in (results / "odd").rglob("log-*.out"))
    assert "error: config.json feed_forward_proj 'gated-softplus': this version imports" in log
    assert not (results / "odd" / "convert_nemo" / "model.nemo").exists()
    assert run_main(*base).returncode != 0  # hf_model_dir is asked for
