"""T5 fine-tuning for real on the CPU, through `python3 main.py`: text-to-text files (an input
per line, its answer on the same line of another file) tune a converted tiny T5 on a mapping it
cannot know; validation loss falls and greedy answers reach a stated exact match; TP2 with
sequence parallelism and two pipeline stages (the encoder on the first, the decoder on the
last) train exactly as one process does; a run resumes exactly; bad input is one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

# The families register the tensor shapes the portable file checks compare weights with.
import launcher_scripts.families  # noqa: F401
from launcher_scripts.formats.portable_check import inspect_portable
from launcher_scripts.jobs.fine_tuning import sft_data
from tests.support.commands import run_main, run_module
from tests.support.sft_task import write_text_to_text_task
from tests.support.training import in_process_check

STAGE = "fine_tuning"
# One worker runs the module's tests one after another: its module-scoped runs (the tuned T5,
# the LoRA on it) are then made once, not again whenever another module's test came between.
pytestmark = pytest.mark.xdist_group("t5_tuning")


@pytest.fixture(scope="module")
def t5_base(t5_converted: Path) -> Path:
    return t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return write_text_to_text_task(tmp_path_factory.mktemp("t5_task"))


def tuning(
    results: Path,
    base: Path,
    task: dict[str, tuple[Path, Path]],
    *extra: str,
    stage: str = STAGE,
    recipe: str = "t5/custom_task",
) -> list[str]:
    """A T5 tuning recipe on the task: CPU, one process, short sequences (fine_tuning's
    recipes have a constant rate, so a shorter run's steps are a longer one's first steps)."""
    data = f"{stage}.model.data"
    (train_src, train_tgt), (val_src, val_tgt) = task["train"], task["val"]
    return [
        f"stages=[{stage}]",
        f"{stage}={recipe}",
        f"base_results_dir={results}",
        f"{stage}.run.model_train_name=t5_tiny",
        f"{stage}.model.restore_from_path={base}",
        f"{data}.train_ds.src_file_name={train_src}",
        f"{data}.train_ds.tgt_file_name={train_tgt}",
        f"{data}.validation_ds.src_file_name={val_src}",
        f"{data}.validation_ds.tgt_file_name={val_tgt}",
        f"{data}.train_ds.max_src_seq_length=32",
        f"{data}.train_ds.max_tgt_seq_length=4",
        f"{stage}.trainer.accelerator=cpu",
        f"{stage}.trainer.precision=32",
        f"{stage}.trainer.devices=1",
        f"{stage}.trainer.log_every_n_steps=10",
        f"{stage}.model.global_batch_size=8",  # the whole mapping at each step
        f"{stage}.model.micro_batch_size=4",
        f"{stage}.model.hidden_dropout=0.0",
        f"{stage}.model.attention_dropout=0.0",
        f"{stage}.model.optim.lr=2e-3",
        *extra,
    ]


def run_stage(*overrides: str) -> subprocess.CompletedProcess:
    result = run_main(*overrides, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def log_dir(results: Path, task_name: str = "custom_task") -> Path:
    return results / "t5_tiny" / task_name / "results"


def records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def train_losses(folder: Path) -> dict[int, float]:
    return {
        r["step"]: r["reduced_train_loss"] for r in records(folder) if "reduced_train_loss" in r
    }


def metric(folder: Path, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r[name]) for r in records(folder) if name in r]


@pytest.fixture(scope="module")
def tuned(
    t5_base: Path, task: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Full fine-tuning for 120 steps, validated (loss and exact match) every 10: the run the
    layout and resume tests compare with."""
    results = tmp_path_factory.mktemp("t5_tuned")
    run_stage(
        *tuning(results, t5_base, task),
        f"{STAGE}.trainer.max_steps=120",
        f"{STAGE}.trainer.val_check_interval=10",
        f"{STAGE}.trainer.log_every_n_steps=5",
        f"{STAGE}.model.data.validation_ds.write_predictions_to_file=true",
    )
    return log_dir(results)


def test_fine_tuning_learns_the_mapping_and_writes_a_t5_model(tuned: Path) -> None:
    losses = metric(tuned, "val_loss")
    assert losses[0][0] == 0 and losses[0][1] > 5.0, losses  # the base cannot know it
    assert losses[-1][0] == 120 and losses[-1][1] < 0.1, losses
    matches = metric(tuned, "validation_exact_string_match")
    assert matches[0] == (0, 0.0) and matches[-1][1] == 1.0, matches
    predictions = [
        json.loads(line)
        for line in (tuned / "validation_predictions_val_src.jsonl").read_text().splitlines()
    ]
    assert len(predictions) == 8
    assert all(row["pred"] == row["label"] for row in predictions), predictions
    model = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    config = inspect_portable(model).config  # whole, and its shapes agree with its config
    assert config.model_family == "t5"


@pytest.mark.parametrize(
    "layout",
    [
        (
            "tensor_model_parallel_size=2",
            "sequence_parallel=true",
        ),
        ("pipeline_model_parallel_size=2",),
    ],
    ids=["tp2-sequence-parallel", "pp2"],
)
def test_layouts_tune_as_one_process_does(
    layout: tuple[str, ...],
    tuned: Path,
    t5_base: Path,
    task: dict[str, tuple[Path, Path]],
    tmp_path: Path,
) -> None:
    """Over the first steps: later, Adam turns rounding differences in near-zero gradients
    (sums in another order) into whole steps, and the runs part."""
    run_stage(
        *tuning(tmp_path, t5_base, task),
        f"{STAGE}.trainer.devices=2",
        f"{STAGE}.trainer.max_steps=10",
        f"{STAGE}.trainer.val_check_interval=10",
        f"{STAGE}.trainer.log_every_n_steps=5",
        *(f"{STAGE}.model.{setting}" for setting in layout),
    )
    folder = log_dir(tmp_path)
    mine, reference = train_losses(folder), train_losses(tuned)
    assert list(mine) == [5, 10]
    for step, loss in mine.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), (step, mine, reference)
    # Validation, and greedy answers through the layout's encoder and decoder.
    for name in ("val_loss", "validation_exact_string_match"):
        for step in (0, 10):
            ours, theirs = dict(metric(folder, name))[step], dict(metric(tuned, name))[step]
            assert ours == pytest.approx(theirs, rel=1e-4), (name, step)


def test_a_longer_rerun_resumes_exactly(
    tuned: Path, t5_base: Path, task: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """10 steps, then the same command with max_steps 20: it resumes from step 10 and its
    steps 15 and 20 are the uninterrupted run's."""
    common = (
        *tuning(tmp_path, t5_base, task),
        f"{STAGE}.trainer.val_check_interval=100",
        f"{STAGE}.trainer.log_every_n_steps=5",  # the reference's: a logged loss is its interval's
    )
    run_stage(*common, f"{STAGE}.trainer.max_steps=10")
    run_stage(*common, f"{STAGE}.trainer.max_steps=20")
    folder = log_dir(tmp_path)
    mine, reference = train_losses(folder), train_losses(tuned)
    assert sorted(mine) == [5, 10, 15, 20]
    assert "at step 10 (80 samples consumed)" in _job_log(folder.parent)
    for step in (15, 20):
        assert mine[step] == pytest.approx(reference[step], rel=1e-6), (step, mine, reference)


# ---- PEFT ----------------------------------------------------------------------------------
# The base is the fine-tuned model above: a T5 that reads its input (the briefly pretrained one
# barely does, which leaves a method working only through the encoder nothing to move). The
# task maps the same inputs to other answers, which that model gets wrong.


@pytest.fixture(scope="module")
def remapped(
    task: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("t5_remapped")
    paths = {}
    for name, (source, target) in task.items():
        answers = target.read_text().splitlines()
        shifted = folder / f"{name}_tgt.txt"
        shifted.write_text("".join(f"{a}\n" for a in answers[1:] + answers[:1]))
        paths[name] = (source, shifted)
    return paths


def peft_run(
    results: Path, base: Path, task: dict[str, tuple[Path, Path]], scheme: str, *extra: str
) -> Path:
    run_stage(
        *tuning(results, base, task, stage="peft", recipe="t5/squad"),
        f"peft.model.peft.peft_scheme={scheme}",
        "peft.run.task_name=remapped",
        "peft.model.optim.sched.warmup_steps=2",
        "peft.model.peft.p_tuning.bottleneck_dim=64",
        *extra,
    )
    return log_dir(results, "peft_remapped")


# A constant rate after the warm-up: a shorter run's steps are the longer one's first steps.
LORA = (
    "peft.model.data.validation_ds.write_predictions_to_file=true",
    "peft.model.peft.lora_tuning.target_modules=all",
    "peft.model.peft.lora_tuning.adapter_dim=16",
    "peft.model.optim.sched.name=constant",
    "peft.trainer.log_every_n_steps=5",
    "peft.trainer.val_check_interval=40",
    "peft.model.data.validation_ds.metric.name=exact_string_match",
)


@pytest.fixture(scope="module")
def t5_lora(
    tuned: Path, remapped: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """LoRA on every linear of both blocks (the decoder's cross-attention too), rank 16, 40
    steps (validated at 0 and 40: it answers every remapped input by step 40)."""
    base = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    results = tmp_path_factory.mktemp("t5_lora")
    return peft_run(results, base, remapped, "lora", *LORA, "peft.trainer.max_steps=40")


def test_lora_learns_a_new_mapping(t5_lora: Path) -> None:
    losses = metric(t5_lora, "val_loss")
    assert losses[-1][1] < 0.3 * losses[0][1], losses
    matches = metric(t5_lora, "validation_exact_string_match")
    assert matches[0] == (0, 0.0) and matches[-1][1] >= 0.75, matches


def test_the_t5_peft_file_holds_only_the_adapters(t5_lora: Path, tuned: Path) -> None:
    from launcher_scripts.jobs.fine_tuning import peft_file

    path = t5_lora / "checkpoints" / "megatron_t5_peft_lora.nemo"
    loaded = peft_file.read(path)
    assert all(".peft." in key for key in loaded.tensors), sorted(loaded.tensors)
    # Two layers a block; A and B of four linears a layer, and of the decoder's three
    # cross-attention linears.
    assert len(loaded.tensors) == 2 * (2 * 4 + 2 * 7), sorted(loaded.tensors)
    assert any(".peft.decoder.1.cross_attention_kv." in key for key in loaded.tensors)
    base = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    # Rank 16 on every linear of a 128-wide model is a tenth of it; at real widths far less.
    assert path.stat().st_size < 0.15 * base.stat().st_size


def test_t5_base_weights_stay_bit_identical(t5_lora: Path) -> None:
    report = in_process_check("peft_frozen", t5_lora, "3")
    assert report["base_tensors"] > 10 and report["base_changed"] == [], report
    assert report["peft_changed"] == report["peft_tensors"] > 0, report


def test_lora_at_tp2_trains_as_one_process(
    t5_lora: Path, tuned: Path, remapped: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The added tensors start and step the same whatever the layout (over the first steps:
    later, Adam turns rounding differences in near-zero gradients into whole steps)."""
    base = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    folder = peft_run(
        tmp_path,
        base,
        remapped,
        "lora",
        *LORA,
        "peft.trainer.max_steps=10",
        "peft.trainer.devices=2",
        "peft.model.tensor_model_parallel_size=2",
    )
    mine, reference = train_losses(folder), train_losses(t5_lora)
    assert list(mine) == [5, 10]
    for step, loss in mine.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), (step, mine, reference)
    for name in ("val_loss", "validation_exact_string_match"):
        assert metric(folder, name)[0] == pytest.approx(metric(t5_lora, name)[0], rel=1e-5)


@pytest.fixture(scope="module")
def one_answer(
    task: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """The same inputs, all answered by one word: a task for a prompt, which acts through the
    encoder only (and on a 2-layer, 128-wide T5, whose encoder output is RMS-normalised, has
    little reach: it steers the decoder, it does not rewrite a mapping)."""
    folder = tmp_path_factory.mktemp("t5_one_answer")
    paths = {}
    for name, (source, target) in task.items():
        answers = target.read_text().splitlines()
        same = folder / f"{name}_tgt.txt"
        same.write_text(f"{answers[0]}\n" * len(answers))
        paths[name] = (source, same)
    return paths


def as_jsonl(task: dict[str, tuple[Path, Path]], folder: Path) -> dict[str, Path]:
    """The task in the older stages' layout: a JSONL file per split, {"input", "output"}."""
    files = {}
    for name, (source, target) in task.items():
        pairs = zip(source.read_text().splitlines(), target.read_text().splitlines(), strict=True)
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text(
            "".join(json.dumps({"input": i, "output": o}) + "\n" for i, o in pairs)
        )
    return files


def template_run(
    results: Path, base: Path, task: dict[str, tuple[Path, Path]], stage: str, *extra: str
) -> Path:
    """An older-layout stage (prompt_learning, adapter_learning, ia3_learning) on the task:
    one task template, file lists, encoder and decoder lengths."""
    files = as_jsonl(task, results)
    template = (
        "<|VIRTUAL_PROMPT_0|> {input} {output}"
        if stage == "prompt_learning"
        else "{input} {output}"
    )
    run_stage(
        f"stages=[{stage}]",
        f"{stage}=t5/squad",
        f"base_results_dir={results}",
        f"{stage}.run.model_train_name=t5_tiny",
        f"{stage}.model.language_model_path={base}",
        f"{stage}.model.data.train_ds=[{files['train']}]",
        f"{stage}.model.data.validation_ds=[{files['val']}]",
        f"{stage}.model.task_templates.0.prompt_template='{template}'",
        f"{stage}.model.task_templates.0.answer_field=output",
        f"{stage}.model.task_templates.0.truncate_field=input",
        f"{stage}.model.encoder_seq_length=32",
        f"{stage}.model.decoder_seq_length=4",
        f"{stage}.model.global_batch_size=8",
        f"{stage}.model.micro_batch_size=4",
        f"{stage}.model.optim.sched.warmup_steps=2",
        f"{stage}.trainer.accelerator=cpu",
        f"{stage}.trainer.precision=32",
        f"{stage}.trainer.devices=1",
        f"{stage}.trainer.max_steps=40",
        f"{stage}.trainer.val_check_interval=40",
        *extra,
    )
    return results / "t5_tiny" / f"{stage}_squad" / "results"


# Each method once; the adapter, IA3 and P-tuning through the older stages' layout (a task
# template and JSONL files), which shares the methods' code with the peft stage.
@pytest.mark.parametrize(
    ("stage", "scheme", "extra", "ratio"),
    [
        (
            "adapter_learning",
            "adapter",
            [
                "adapter_learning.model.adapter_tuning.adapter_dropout=0.0",
                "adapter_learning.model.optim.lr=2e-3",
            ],
            0.7,
        ),
        ("ia3_learning", "ia3", ["ia3_learning.model.optim.lr=3e-2"], 0.7),
        (
            "prompt_learning",
            "ptuning",
            [
                "prompt_learning.model.optim.lr=1e-2",
                "prompt_learning.model.task_templates.0.total_virtual_tokens=10",
                "prompt_learning.model.task_templates.0.virtual_token_splits=[10]",
                "prompt_learning.model.p_tuning.encoder_hidden=64",
            ],
            0.85,
        ),
        ("peft", "prompt_tuning", ["peft.model.optim.lr=1e-2"], 0.85),
    ],
)
def test_each_t5_peft_method_lowers_validation_loss(
    stage: str,
    scheme: str,
    extra: list[str],
    ratio: float,
    tuned: Path,
    remapped: dict[str, tuple[Path, Path]],
    one_answer: dict[str, tuple[Path, Path]],
    tmp_path: Path,
) -> None:
    base = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    task = one_answer if ratio > 0.7 else remapped
    if stage == "peft":
        folder = peft_run(
            tmp_path,
            base,
            task,
            scheme,
            *extra,
            "peft.trainer.max_steps=40",
            "peft.trainer.val_check_interval=40",
        )
        output = folder / "checkpoints" / f"megatron_t5_peft_{scheme}.nemo"
    else:
        folder = template_run(tmp_path, base, task, stage, *extra)
        output = next(folder.glob("megatron_t5_*.nemo"))
    (start, before), (end, after) = metric(folder, "val_loss")[0], metric(folder, "val_loss")[-1]
    assert (start, end) == (0, 40)
    assert after < ratio * before, (scheme, before, after)
    assert output.stat().st_size < 2**20


# ---- evaluation ----------------------------------------------------------------------------


def evaluation(results: Path, task: dict[str, tuple[Path, Path]], *extra: str) -> Path:
    """A T5 evaluation recipe on the task's validation and test pairs (two named files), on
    the CPU; returns its results dir."""
    (val_src, val_tgt), (test_src, test_tgt) = task["val"], task["test"]
    run_stage(
        "stages=[evaluation]",
        f"base_results_dir={results}",
        "evaluation.run.model_train_name=t5_tiny",
        "evaluation.run.accelerator=cpu",
        f"evaluation.data.src_file_name=[{val_src},{test_src}]",
        f"evaluation.data.tgt_file_name=[{val_tgt},{test_tgt}]",
        "evaluation.data.names=[val,test]",
        "evaluation.data.max_src_seq_length=32",
        "evaluation.data.max_tgt_seq_length=4",
        "evaluation.model.eval_batch_size=4",
        *extra,
    )
    return next(p.parent for p in results.rglob("results.json"))


def predictions_of(path: Path) -> list[tuple[str, str]]:
    return [(row["input"], row["pred"]) for row in map(json.loads, path.open())]


def assert_answers_as_validation_did(folder: Path, validated: Path) -> None:
    """The evaluation in `folder` scored both files, and answered the validation file's inputs
    as the tuning run's last validation (`validated`) did."""
    results = json.loads((folder / "results.json").read_text())
    assert results["samples"] == 16 and sorted(results["per_file"]) == ["test", "val"]
    assert results["per_file"]["val"] == results["per_file"]["test"]  # the same questions
    rows = predictions_of(folder / "predictions.jsonl")
    assert rows[:8] == predictions_of(validated)  # the last validation, answered the same way
    assert "| test | " in (folder / "results.md").read_text()


# One pipeline stage is the merged-LoRA test's evaluation: the same recipe (t5/squad) and
# layout on a fine-tuned model file, answering as its tuning's validation did.
@pytest.mark.parametrize("pipeline", [2])
def test_evaluation_answers_as_validation_did_at_any_layout(
    pipeline: int, tuned: Path, task: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    model = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    folder = evaluation(
        tmp_path,
        task,
        "evaluation=t5/squad",
        f"evaluation.model.restore_from_path={model}",
        f"evaluation.model.pipeline_model_parallel_size={pipeline}",
    )
    assert_answers_as_validation_did(folder, tuned / "validation_predictions_val_src.jsonl")


def test_evaluation_of_base_plus_lora(
    t5_lora: Path, tuned: Path, remapped: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    base = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    lora = t5_lora / "checkpoints" / "megatron_t5_peft_lora.nemo"
    folder = evaluation(
        tmp_path,
        remapped,
        "evaluation=peft_t5/squad",
        f"evaluation.model.language_model_path={base}",
        f"evaluation.model.peft_model_file={lora}",
        "evaluation.model.tensor_model_parallel_size=2",
    )
    rows = predictions_of(folder / "predictions.jsonl")
    validated = predictions_of(t5_lora / "validation_predictions_val_src.jsonl")
    assert rows[:8] == validated


def test_merged_lora_answers_as_base_plus_lora(
    t5_lora: Path, tuned: Path, remapped: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """LoRA folded into both blocks' weights (the cross-attention's too) is one model that
    answers what base + LoRA answered; evaluated on one process as any fine-tuned model is."""
    base = tuned / "checkpoints" / "megatron_t5_custom_task.nemo"
    lora = t5_lora / "checkpoints" / "megatron_t5_peft_lora.nemo"
    merged = tmp_path / "merged.nemo"
    run_module(
        "launcher_scripts", "merge-lora", str(base), str(lora), str(merged), env=None, timeout=300
    )
    folder = evaluation(
        tmp_path / "evaluation",
        remapped,
        "evaluation=t5/squad",
        f"evaluation.model.restore_from_path={merged}",
        "evaluation.model.pipeline_model_parallel_size=1",
    )
    assert_answers_as_validation_did(folder, t5_lora / "validation_predictions_val_src.jsonl")


def _job_log(run_dir: Path) -> str:
    return "".join(path.read_text() for path in sorted(run_dir.glob("log-*.out")))


def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            [f"{STAGE}.model.data.train_ds.tgt_file_name=[/a.txt,/b.txt]"],
            [f"{STAGE}.model.data.train_ds.tgt_file_name", "2 target files for 1 source"],
        ),
        (
            [f"{STAGE}.trainer.devices=3", f"{STAGE}.model.pipeline_model_parallel_size=3"],
            [f"{STAGE}.model.pipeline_model_parallel_split_rank", "must be PP - 1 = 2"],
        ),
        (
            [f"{STAGE}.model.data.validation_ds.names=[a,b]"],
            [f"{STAGE}.model.data.validation_ds.names", "one name per source file (1)"],
        ),
        (
            [f"{STAGE}.model.data.train_ds.concat_sampling_technique=loud"],
            [f"{STAGE}.model.data.train_ds.src_file_name"],
        ),
    ],
    ids=["targets-per-source", "split-rank", "names", "one-file-needs-no-technique"],
)
def test_bad_t5_tuning_settings_are_one_line(
    overrides: list[str],
    fragments: list[str],
    t5_base: Path,
    task: dict[str, tuple[Path, Path]],
    tmp_path: Path,
) -> None:
    if overrides[0].endswith("concat_sampling_technique=loud"):
        # With one training file no technique is read: two files make it count.
        (src, tgt) = task["train"]
        overrides = [
            *overrides,
            f"{STAGE}.model.data.train_ds.src_file_name=[{src},{src}]",
            f"{STAGE}.model.data.train_ds.tgt_file_name=[{tgt},{tgt}]",
        ]
        fragments = [f"{STAGE}.model.data.train_ds.concat_sampling_technique", "'loud'"]
    result = run_main(*tuning(tmp_path, t5_base, task), *overrides)
    one_line_error(result, *fragments)
    assert not (tmp_path / "t5_tiny").exists()


def test_a_gpt_base_for_a_t5_recipe_is_one_line(
    tiny_portable: Path, task: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    result = run_main(*tuning(tmp_path, tiny_portable, task))
    one_line_error(result, f"{STAGE}.model.restore_from_path", "holds a gpt model", "tunes t5 ones")


def test_packing_is_not_a_t5_setting(
    t5_base: Path, task: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Packing is GPT's (an encoder-decoder pads input and answer to their own limits)."""
    result = run_main(
        *tuning(tmp_path, t5_base, task), f"+{STAGE}.model.data.train_ds.packed_sequence=true"
    )
    one_line_error(result, f"{STAGE}.model.data.train_ds.packed_sequence", "model_family t5")


def test_unequal_input_and_answer_files_stop_the_job_in_one_line(tmp_path: Path) -> None:
    source, target = tmp_path / "src.txt", tmp_path / "tgt.txt"
    source.write_text("a\nb\nc\n")
    target.write_text("x\ny\n")
    counts = sft_data.Counts()
    with pytest.raises(sft_data.SftDataError, match=r"tgt.txt ends at line 2 and .*src.txt"):
        list(sft_data.read_pairs(source, target, _Words(), sft_data.SftFormat(), counts))


class _Words:
    """A tokenizer of whitespace-separated words (ids by first appearance)."""

    eod_id = 0

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, len(self.ids) + 1) for word in text.split()]


# ---- the text side, in process --------------------------------------------------------------


def sentencepiece_model(folder: Path) -> Path:
    """A small SentencePiece model with mT5's ids: padding 0, then unknown, <s>, </s>."""
    import sentencepiece

    corpus = folder / "corpus.txt"
    words = ["the", "river", "runs", "north", "to", "the", "sea", "and", "the", "village"]
    corpus.write_text("".join(" ".join(words[i:] + words[:i]) + "\n" for i in range(len(words))))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "sp"), vocab_size=24, pad_id=0, unk_id=1,
        bos_id=2, eos_id=3, minloglevel=2,
    )  # fmt: skip
    return folder / "sp.model"


def wordpiece_vocab(folder: Path) -> Path:
    path = folder / "vocab.txt"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "river", "north", "run", "##s"]
    path.write_text("\n".join(words) + "\n")
    return path


def t5_text(tokenizer: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    from launcher_scripts.jobs.models.t5_tuning import T5Text

    return T5Text(OmegaConf.create({"tokenizer": {"num_sentinel_tokens": 3, **tokenizer}}))


@pytest.mark.parametrize("kind", ["wordpiece", "sentencepiece"])
def test_text_round_trips_and_leaves_out_what_is_not_text(kind: str, tmp_path: Path) -> None:
    from launcher_scripts.jobs.models.t5_tuning import GenerationText

    if kind == "wordpiece":
        text = t5_text(
            {"vocab_file": str(wordpiece_vocab(tmp_path)), "type": "BertWordPieceLowerCase"}
        )
        # [BOS] and [EOS] follow the 10 WordPieces, then the sentinels.
        assert (text.bos_id, text.eos_id, text.own, text.vocab_size) == (10, 11, 10, 15)
    else:
        text = t5_text({"model": str(sentencepiece_model(tmp_path))})
        assert (text.pad_id, text.bos_id, text.eos_id) == (0, 2, 3)
    ids = text.encode("the river runs north")
    assert text.decode(ids) == "the river runs north"
    sentinel = text.vocab_size - 1
    assert text.decode([text.bos_id, *ids, sentinel, text.eos_id, 0]) == text.decode(ids)
    prompts = GenerationText(text, encoder_length=3)
    row = prompts.encode("the river runs north")
    assert row == [*ids[:2], text.eos_id, text.bos_id]  # cut as training cuts inputs
    assert prompts.decode(row) == ""  # a row decodes to what follows the decoder's start
    assert prompts.decode([*row, *ids[1:3]]) == text.decode(ids[1:3])


def test_a_record_becomes_encoder_and_decoder_inputs(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from launcher_scripts.jobs.models.t5_tuning import encode, sample_maker

    text = t5_text({"vocab_file": str(wordpiece_vocab(tmp_path)), "type": "BertWordPieceLowerCase"})
    fmt = sft_data.SftFormat(max_seq_length=4, max_target_length=3)
    counts = sft_data.Counts()
    encoded = encode(text, fmt, "the river runs north", "north", counts, "f:1")
    assert encoded is not None and counts.truncated == 1  # the input lost its end
    cfg = OmegaConf.create({"model": {"data": {"seq_length": 4, "seq_length_dec": 3}}})
    sample = {k: v.tolist() for k, v in sample_maker(cfg, text)(encoded).items()}
    the, river, run = text.encode("the river run")
    north = text.encode("north")[0]
    assert sample["text_enc"] == [the, river, run, text.eos_id]
    assert sample["text_dec"] == [text.bos_id, north, 0]
    assert sample["labels"] == [north, text.eos_id, -1]
    assert sample["loss_mask"] == [1.0, 1.0, 0.0]
    assert sample["dec_mask"] == [1, 1, 0]
    # An answer over its limit drops the record, unless truncation_field cuts answers.
    assert encode(text, fmt, "the", "the river north", counts, "f:2") is None
    assert counts.dropped_too_long == 1
    cut = sft_data.SftFormat(max_seq_length=4, max_target_length=3, truncation_field="answer")
    kept = encode(text, cut, "the", "the river north", counts, "f:3")
    assert kept is not None and kept.ids[kept.prompt_length :] == text.encode("the river")
    padding = sample_maker(cfg, text)(None)
    assert padding["loss_mask"].sum() == 0 and padding["text_enc"].sum() == 0
