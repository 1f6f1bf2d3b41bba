"""Importing Hugging Face decoder-only models as GPT models: tiny random ones that transformers
itself builds and saves (tests/scripts/make_hf_gpt.py, no hub) for Llama (Llama 3's rope
scaling and GQA; tied, with a head size of its own), Mistral, Qwen2, StableLM and GPT-2,
imported through `python3 main.py conversion=hf_import`.

After import our logits equal transformers' to 1e-4 in fp32 at TP1, TP2 and PP2, greedy
generation gives transformers' tokens and our tokenizer its ids; written back as a Hugging Face
directory the tensors are the original ones exactly, as the original class. A LoRA tune of an
imported Llama goes back to Hugging Face (`conversion=hf_export`) merged, and transformers
computes there what we compute for the merged model. What cannot be imported exactly is one
line before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The families register the tensor shapes the portable file checks compare weights with.
import launcher_scripts.families  # noqa: F401
from tests.support import hf_dirs
from tests.support.commands import (
    module_report,
    one_error_line,
    run_main,
    run_module,
)
from tests.support.conversion import (
    architecture_overrides,
    assert_import_refused,
    assert_padded_and_unpadded_exactly,
    checks,
    continued_on_cpu,
    hf_imported,
    prepared_with,
)
from tests.support.hf_dirs import Alteration
from tests.support.sft_task import write_mapping_task

CLASSES = {
    "llama3": "LlamaForCausalLM",
    "llama_tied": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_gpt") / "models"
    run_module("tests.scripts.make_hf_gpt", str(folder))
    return folder


@pytest.fixture(scope="module")
def imported(hf_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant imported through main.py: results/<variant>/convert_nemo/model.nemo."""
    results = tmp_path_factory.mktemp("imported")
    for variant in CLASSES:
        hf_imported(hf_models / variant, results)
    return results


def model_file(imported: Path, variant: str) -> Path:
    return imported / variant / "convert_nemo" / "model.nemo"


def assert_computes_what_transformers_does(report: dict) -> None:
    assert report["logits"] <= 1e-4, report
    ours, theirs = report["greedy"]
    assert ours == theirs and any(len(tokens) > 1 for tokens in ours), report
    assert report["token_ids"], report


@pytest.fixture(scope="module")
def one_process_reports(
    hf_models: Path,
    imported: Path,
    lora_tune: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict]:
    """hf_gpt_check's reports at TP1, one launch (one start-up) for every case of the module
    that takes one process: each imported variant (written back to a directory of its own)
    and, as "lora", the merged LoRA tune against its Hugging Face export."""
    back = tmp_path_factory.mktemp("back")
    cases = [(model_file(imported, v), hf_models / v, back / v, 1, 1) for v in CLASSES]
    cases.append((lora_tune["merged"], lora_tune["back"], "-", 1, 1))
    return dict(zip([*CLASSES, "lora"], checks(*cases), strict=True))


@pytest.mark.slow
def test_imported_models_compute_what_transformers_does_and_go_back_exactly(
    one_process_reports: dict[str, dict],
) -> None:
    for variant in CLASSES:
        report = one_process_reports[variant]
        assert_computes_what_transformers_does(report)
        assert report["keys_equal"] and report["tensors_equal"], (variant, report)
        assert report["class"] == CLASSES[variant], (variant, report)


def test_a_rotary_model_s_cache_is_the_full_pass_through_every_move(imported: Path) -> None:
    """Llama's keys are stored rotated at their cache positions (rope_at_append.py): every
    logits row through joins, forks, drops, a move right and compactions (which rotate the
    moved keys on) equals the full pass, and generate() through the cache gives what it gives
    over whole rows."""
    report = module_report("tests.scripts.kv_cache_check", str(model_file(imported, "llama3")))
    script = report["script"]
    assert script["max_diff"] < 1e-4, script
    for move in ("moved_right", "compacted", "forked", "dropped", "joined"):
        assert script[move] >= 1, (move, script)
    assert report["engine"] == {"greedy": True, "beam": True, "sampled": True}


# Imports whose vocabulary rows are padded for TP: variant -> (TP, make_vocab_size_divisible_by,
# the padded rows, our tables with a row per vocabulary entry -> the checkpoint's).
PADDED = {
    "gpt2_odd": (2, 1, 1002, {"embedding.word_embeddings.weight": "transformer.wte.weight"}),
    "llama3": (
        2,
        3,
        516,
        {
            "embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "output_layer.weight": "lm_head.weight",
        },
    ),
}


@pytest.fixture(scope="module")
def padded_imports(hf_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each of PADDED imported through main.py at its TP and divisor."""
    results = tmp_path_factory.mktemp("padded")
    return {
        variant: hf_imported(
            hf_models / variant,
            results,
            f"conversion.model.tensor_model_parallel_size={tensor}",
            f"conversion.model.make_vocab_size_divisible_by={divisor}",
        )
        for variant, (tensor, divisor, *_) in PADDED.items()
    }


@pytest.mark.parametrize("variant", PADDED)
def test_a_vocabulary_tp_does_not_divide_is_padded_and_goes_back_exactly(
    variant: str, hf_models: Path, padded_imports: dict[str, Path]
) -> None:
    """GPT-2's 1001 rows at TP2 (tied), Llama 3's 512 to a multiple of 3 x TP2 (its own output
    layer too): the checkpoint's rows as they are, then copies of the last one (Megatron's
    padding); the file records the checkpoint's count, and the export's tensors drop the rest."""
    assert_padded_and_unpadded_exactly(
        padded_imports[variant], hf_models / variant, *PADDED[variant]
    )


@pytest.mark.slow
def test_imported_models_compute_the_same_split_over_ranks(
    hf_models: Path, imported: Path, padded_imports: dict[str, Path], tmp_path: Path
) -> None:
    """Llama 3 (GQA: two query groups, one per rank) and StableLM (partial rotary, Q/K/V
    biases) at TP2; Qwen2 (tied) and GPT-2 (learned positions) at PP2; the padded imports at
    TP2, on the checkpoint's rows, and written back exactly."""
    cases = [("llama3", 2, 1), ("stablelm", 2, 1), ("qwen2", 1, 2), ("gpt2", 1, 2)]
    padded = [(padded_imports[v], hf_models / v, tmp_path / v, 2, 1) for v in PADDED]
    reports = checks(
        *((model_file(imported, v), hf_models / v, "-", tp, pp) for v, tp, pp in cases), *padded
    )
    for report in reports:
        assert_computes_what_transformers_does(report)
    for variant, report in zip(PADDED, reports[len(cases) :], strict=True):
        assert report["keys_equal"] and report["tensors_equal"], (variant, report)


@pytest.fixture(scope="module")
def lora_tune(imported: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three commands of docs/conversion.md: import (the `imported` fixture), PEFT with the
    Llama 3 recipe, export with the LoRA file folded in (back/); and our merged model
    (merged.nemo) for hf_gpt_check to compare with that export (in one_process_reports'
    launch). The tune's results folder is "log"."""
    tmp_path = tmp_path_factory.mktemp("lora")
    task = write_mapping_task(tmp_path / "task")
    results = tmp_path / "results"
    data = "peft.model.data"
    tuned = run_main(
        "stages=[peft]",
        "peft=llama3/8b_squad",
        f"base_results_dir={results}",
        "peft.run.model_train_name=llama3",
        f"peft.model.restore_from_path={model_file(imported, 'llama3')}",
        f"{data}.train_ds.file_names=[{task['train']}]",
        f"{data}.validation_ds.file_names=[{task['val']}]",
        f"{data}.test_ds.file_names=[{task['test']}]",
        f"{data}.train_ds.max_seq_length=32",
        "peft.trainer.accelerator=cpu",
        "peft.trainer.precision=32",
        "peft.trainer.devices=1",
        "peft.trainer.max_steps=60",
        "peft.trainer.val_check_interval=60",
        "peft.trainer.log_every_n_steps=10",
        "peft.model.global_batch_size=4",
        "peft.model.micro_batch_size=4",
        "peft.model.optim.lr=1e-2",
        "peft.model.optim.sched.warmup_steps=2",
        "peft.model.peft.lora_tuning.target_modules=[attention_qkv,attention_dense,mlp_fc1,mlp_fc2]",
        "peft.model.peft.lora_tuning.adapter_dim=16",
        timeout=900,
    )
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    log = results / "llama3" / "peft_squad" / "results"
    lora = log / "checkpoints" / "megatron_gpt_peft_lora.nemo"

    exported = run_main(
        "stages=[conversion]",
        "conversion=hf_export",
        f"base_results_dir={imported}",
        "conversion.run.model_train_name=llama3",  # its nemo_file: the import's
        f"conversion.peft_file={lora}",
        f"conversion.run.output_path={tmp_path / 'back'}",
    )
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    merged = tmp_path / "merged.nemo"
    # `python3 -m launcher_scripts merge-lora BASE PEFT OUT`'s main, in this process: it only
    # reads and writes files (the command itself is tested with the fine-tuning tests).
    from launcher_scripts.jobs.fine_tuning import merge_lora

    assert merge_lora.main([str(model_file(imported, "llama3")), str(lora), str(merged)]) == 0
    return {"log": log, "back": tmp_path / "back", "merged": merged}


@pytest.mark.slow
def test_a_lora_tune_of_an_imported_llama_goes_back_to_hugging_face_merged(
    hf_models: Path, lora_tune: dict[str, Path], one_process_reports: dict[str, dict]
) -> None:
    """The three commands of docs/conversion.md (lora_tune): the tune learns, and the export is the
    merged model as a Hugging Face Llama."""
    log = lora_tune["log"]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [step for step, _ in losses] == [0, 60], losses
    # The random model's output layer (std 0.02, not tuned) bounds how far its logits can
    # move: a clear fall, not a solved task.
    assert losses[1][1] < losses[0][1] - 0.75, losses
    # transformers on the export computes what we compute for the merged model.
    report = one_process_reports["lora"]
    assert_computes_what_transformers_does(report)
    config = json.loads((lora_tune["back"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"], config
    # ... which is not the base: the update is in the weights.
    from safetensors.torch import load_file

    original = load_file(hf_models / "llama3" / "model.safetensors")
    back = load_file(lora_tune["back"] / "model.safetensors")
    changed = sorted(k for k in original if not (original[k] == back[k]).all())
    assert changed and all(k.endswith("proj.weight") for k in changed), changed


@pytest.mark.slow
def test_continued_pretraining_starts_from_the_imported_weights(
    hf_models: Path, imported: Path, tmp_path: Path
) -> None:
    """Data prepared with the imported model's own tokenizer.json (transformers' ids), then
    `training=llama3/8b` from the imported file at PP2 (each stage reads its own layers of
    it), the conversion stage, to our file and a Hugging Face Llama, and lm-eval's offline
    tasks on the result. At a learning rate of
    1e-12 the converted weights are the imported ones to 1e-9 (a random start is off by
    ~0.02), and the model keeps its tokenizer."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    start = model_file(imported, "llama3")
    results, data = tmp_path / "results", tmp_path / "data"
    corpus = data / "corpus.jsonl"
    data.mkdir()
    lines = ["The river runs north past the market.", "Winter mornings are quiet here."]
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    training = [
        "training=llama3/8b",
        "training.run.hf_model_name=llama3",
        f"training.model.restore_from_path={start}",
        *architecture_overrides(start),
        *continued_on_cpu(data),
        "training.model.tensor_model_parallel_size=1",
        "training.model.pipeline_model_parallel_size=2",
        "training.model.sequence_parallel=False",
    ]
    result = run_main(
        "stages=[data_preparation,training,conversion,evaluation]",
        *prepared_with(hf_models / "llama3" / "tokenizer.json", corpus, data),
        *training,
        "evaluation.run.limit=4",
        f"base_results_dir={results}",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"starting from the weights of {start}" in result.stdout, result.stdout[-3000:]

    dataset = IndexedDataset(str(data / "corpus_text_document"))
    ours = [dataset[i].tolist()[:-1] for i in range(len(dataset))]  # without the end token
    theirs = AutoTokenizer.from_pretrained(hf_models / "llama3")
    assert ours == [theirs(line, add_special_tokens=False)["input_ids"] for line in lines]

    from safetensors.torch import load as load_safetensors

    def weights(path: Path) -> dict:
        import tarfile

        with tarfile.open(path) as tar:
            member = tar.extractfile("model_weights.safetensors")
            assert member is not None
            return load_safetensors(member.read())

    converted = results / "llama3_8b_continued" / "convert_nemo" / "megatron_gpt.nemo"
    before, after = weights(start), weights(converted)
    assert sorted(before) == sorted(after)
    moved = max(float((before[k] - after[k]).abs().max()) for k in before)
    assert moved < 1e-9, moved
    from launcher_scripts.formats import portable

    config = portable.read_config(converted)
    assert config.tokenizer.library == "huggingface", config.tokenizer
    exported = json.loads((converted.parent / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"], exported
    # lm-eval's offline tasks through the model's own tokenizer.
    scores = json.loads((results / "llama3_8b_continued" / "eval_all" / "results.json").read_text())
    assert scores["results"]["tiny_choice"]["sample_len"] == 4, scores["results"]


@pytest.mark.slow
def test_a_recipe_that_describes_another_model_than_the_file_is_one_line(
    imported: Path, tmp_path: Path
) -> None:
    start = model_file(imported, "llama3")
    result = run_main(
        "stages=[training]",
        "training=llama3/8b",
        f"training.model.restore_from_path={start}",
        f"base_results_dir={tmp_path}",
        "dry_run=true",
    )
    one_error_line(result, "training.model.num_layers", "training.model.restore_from_path")


REFUSED = {
    "sliding window": ("mistral", {"sliding_window": 64}, "sliding_window"),
    "yarn": ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    "attention bias": ("llama3", {"attention_bias": True}, "attention_bias"),
    "qk norm": ("stablelm", {"qk_layernorm": True}, "qk_layernorm"),
    "activation": ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_be_imported_exactly_is_one_line_before_anything_runs(
    case: str, hf_models: Path, tmp_path: Path
) -> None:
    variant, fields, named = REFUSED[case]
    odd = tmp_path / "odd"
    odd.mkdir()
    for source in (hf_models / variant).iterdir():
        if source.name != "config.json":
            (odd / source.name).symlink_to(source)
    config = json.loads((hf_models / variant / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | fields))
    assert_import_refused(odd, tmp_path / "results", named)


EMBEDDING = {v: "model.embed_tokens.weight" for v in CLASSES} | {"gpt2": "transformer.wte.weight"}
FEED_FORWARD = {v: ("intermediate_size", "96") for v in CLASSES} | {"gpt2": ("n_inner", "256")}


def disagreements() -> dict[str, tuple[str, list[Alteration], list[str]]]:
    """Each case: (variant, how its directory is altered, what the one line says). The sizes
    are every variant's (all have 512 rows, 64 wide, a feed-forward of 96, GPT-2's 4 x 64)."""
    cases: dict[str, tuple[str, list[Alteration], list[str]]] = {}
    for variant in CLASSES:
        cases[f"vocab_size {variant}"] = (
            variant,
            [hf_dirs.config(vocab_size=500)],
            ["vocab_size is 500", f"{EMBEDDING[variant]} has 512 rows"],
        )
        field, held = FEED_FORWARD[variant]
        cases[f"{field} {variant}"] = (
            variant,
            [hf_dirs.config(**{field: 128})],
            [f"{field} is 128", "mlp.", f"has {held} "],
        )
    for variant in ("llama3", "gpt2"):
        cases[f"tokenizer past the rows {variant}"] = (
            variant,
            [hf_dirs.more_tokens(20)],
            ["tokenizer.json has 520 tokens", f"more than the 512 rows of {EMBEDDING[variant]}"],
        )
        cases[f"corrupt tokenizer.json {variant}"] = (
            variant,
            [hf_dirs.corrupt("tokenizer.json")],
            ["tokenizer.json is not a readable tokenizer"],
        )
    cases["corrupt tokenizer.model mistral"] = (
        "mistral",
        [hf_dirs.corrupt("tokenizer.model")],
        ["tokenizer.model is not a readable tokenizer"],
    )
    for variant in ("llama3", "stablelm"):
        cases[f"no lm_head {variant}"] = (
            variant,
            [hf_dirs.without_tensor("lm_head.weight")],
            ["tie_word_embeddings is false", "no lm_head.weight"],
        )
    cases["a shard missing"] = (
        "qwen2",
        [hf_dirs.sharded_without_its_second_shard],
        [f"names the shard {hf_dirs.MISSING_SHARD}", "is not in"],
    )
    cases["layers past the config's"] = (
        "llama3",
        [hf_dirs.config(num_hidden_layers=3)],
        ["num_hidden_layers is 3", "the checkpoint has 4 layers"],
    )
    return cases


DISAGREEMENTS = disagreements()


@pytest.mark.parametrize("case", DISAGREEMENTS)
def test_a_checkpoint_whose_files_disagree_is_one_line_before_anything_runs(
    case: str, hf_models: Path, tmp_path: Path
) -> None:
    """config.json, the tensors and the tokenizer must describe one model: each field against
    the tensor it sizes, the tokenizer against the embedding's rows, an untied model's output
    layer, the index's shards."""
    variant, alterations, fragments = DISAGREEMENTS[case]
    odd = hf_dirs.altered(hf_models / variant, tmp_path / "odd", *alterations)
    assert_import_refused(odd, tmp_path / "results", *fragments)


def test_a_sentencepiece_tokenizer_past_the_rows_is_one_line(
    hf_models: Path, tmp_path: Path
) -> None:
    """Mistral's tokenizer.model, with more pieces than the embedding has rows."""
    from tests.scripts.make_hf_gpt import sentencepiece_tokenizer

    (tmp_path / "scratch").mkdir()
    larger = sentencepiece_tokenizer(tmp_path / "scratch", 612)  # 600 pieces
    odd = hf_dirs.altered(
        hf_models / "mistral", tmp_path / "odd", hf_dirs.replaced_by("tokenizer.model", larger)
    )
    result = run_main(
        "stages=[conversion]",
        "conversion=hf_import",
        f"conversion.hf_model_dir={odd}",
        f"base_results_dir={tmp_path / 'results'}",
    )
    one_error_line(
        result, "tokenizer.model has 600 tokens", "more than the 512 rows of model.embed_tokens"
    )


def test_a_layout_the_model_cannot_take_is_one_line(hf_models: Path, tmp_path: Path) -> None:
    """Llama 3's two query groups cannot be split four ways."""
    result = run_main(
        "stages=[conversion]",
        "conversion=hf_import",
        f"conversion.hf_model_dir={hf_models / 'llama3'}",
        f"base_results_dir={tmp_path}",
        "conversion.model.tensor_model_parallel_size=4",
    )
    one_error_line(result, "conversion.model.tensor_model_parallel_size")


@pytest.mark.slow
def test_an_export_it_cannot_write_is_one_line_and_writes_nothing(
    imported: Path, tmp_path: Path
) -> None:
    """No file; a PEFT file given as the model; a PEFT file of a method that does not fold
    into the weights."""
    import torch

    from launcher_scripts.jobs.fine_tuning import peft_file
    from launcher_scripts.tuning import PeftSettings

    ia3 = tmp_path / "ia3.nemo"
    peft_file.write(ia3, PeftSettings(scheme="ia3"), {}, {"peft.1.ia3": torch.ones(4)})
    output = tmp_path / "back"
    base = [
        "stages=[conversion]",
        "conversion=hf_export",
        f"base_results_dir={imported}",
        "conversion.run.model_train_name=llama3",
        f"conversion.run.output_path={output}",
    ]
    one_error_line(
        run_main(*base, f"conversion.nemo_file={tmp_path / 'none.nemo'}"),
        "conversion.nemo_file",
        "does not exist",
    )
    one_error_line(
        run_main(*base, f"conversion.nemo_file={ia3}"), "conversion.nemo_file", "PEFT file"
    )
    one_error_line(
        run_main(*base, f"conversion.peft_file={ia3}"),
        "conversion.peft_file",
        "holds ia3, and only LoRA folds into the weights",
    )
    assert not output.exists()
