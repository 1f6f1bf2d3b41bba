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

from tests.support import hf_dirs
from tests.support.commands import one_error_line, run_main, run_module
from tests.support.conversion import (
    assert_import_refused,
    assert_padded_and_unpadded_exactly,
    hf_imported,
)
from tests.support.hf_dirs import Alteration

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


def disagreements() -> dict[str, tuple[str, list[Alteration], list[str]]]:
    """Each case: (variant, how its directory is altered, what the one line says). Every
    variant has 512 rows of 64, a feed-forward of 96, 2 encoder and 3 decoder layers."""
    cases: dict[str, tuple[str, list[Alteration], list[str]]] = {}
    for variant in VARIANTS:
        cases[f"vocab_size {variant}"] = (
            variant,
            [hf_dirs.config(vocab_size=500)],
            ["vocab_size is 500", "shared.weight has 512 rows"],
        )
        cases[f"d_ff {variant}"] = (
            variant,
            [hf_dirs.config(d_ff=128)],
            ["d_ff is 128", "encoder.block.0.layer.1.DenseReluDense.", "has 96 "],
        )
    cases["tokenizer past the rows"] = (
        "t5_v1",
        [hf_dirs.more_tokens(20)],
        ["tokenizer.json has 530 tokens", "more than the 512 rows of shared.weight"],
    )
    cases["corrupt tokenizer.json"] = (
        "mt5",
        [hf_dirs.corrupt("tokenizer.json")],
        ["tokenizer.json is not a readable tokenizer"],
    )
    cases["no lm_head"] = (
        "t5_v1.1",
        [hf_dirs.config(tie_word_embeddings=False), hf_dirs.without_tensor("lm_head.weight")],
        ["tie_word_embeddings is false", "no lm_head.weight"],
    )
    cases["a shard missing"] = (
        "t5_v1.1",
        [hf_dirs.sharded_without_its_second_shard],
        [f"names the shard {hf_dirs.MISSING_SHARD}", "is not in"],
    )
    cases["decoder layers past the config's"] = (
        "mt5",
        [hf_dirs.config(num_decoder_layers=2)],
        ["num_decoder_layers is 2", "the checkpoint has 3 layers"],
    )
    return cases


DISAGREEMENTS = disagreements()


@pytest.mark.parametrize("case", DISAGREEMENTS)
def test_a_checkpoint_whose_files_disagree_is_one_line_before_anything_runs(
    case: str, hf_models: Path, tmp_path: Path
) -> None:
    variant, alterations, fragments = DISAGREEMENTS[case]
    odd = hf_dirs.altered(hf_models / variant, tmp_path / "odd", *alterations)
    assert_import_refused(odd, tmp_path / "results", *fragments)


# variant -> (TP, make_vocab_size_divisible_by, the padded rows, our tables with a row per
# vocabulary entry -> the checkpoint's)
PADDED = {
    "t5_v1": (1, 3, 513, {"embedding.word_embeddings.weight": "shared.weight"}),
    "t5_v1.1": (
        2,
        3,
        516,
        {
            "embedding.word_embeddings.weight": "shared.weight",
            "lm_head.output_layer.weight": "lm_head.weight",
        },
    ),
}


@pytest.mark.parametrize("variant", PADDED)
def test_a_vocabulary_tp_does_not_divide_is_padded_and_goes_back_exactly(
    variant: str, hf_models: Path, tmp_path: Path
) -> None:
    """T5 v1.0 (one table, and the zero bias of megatron-core's output layer) and v1.1 (an
    output layer of its own), padded to a multiple of 3 x TP: the checkpoint's rows, then
    copies of the last one; the export's tensors drop the padding."""
    tensor, divisor, *_ = PADDED[variant]
    model = hf_imported(
        hf_models / variant,
        tmp_path,
        f"conversion.model.tensor_model_parallel_size={tensor}",
        f"conversion.model.make_vocab_size_divisible_by={divisor}",
    )
    assert_padded_and_unpadded_exactly(model, hf_models / variant, *PADDED[variant])
