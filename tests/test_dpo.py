"""Direct preference optimisation (the dpo stage) on the tiny model, end to end through main.py.

The sample pairs (launcher_scripts/sample_data/make_preference_pairs.py) prefer answers that
name a morning time; the tiny base model, trained on a corpus that uses every time alike, does
not answer so. DPO must raise the margin and make the policy's greedy answers follow the rule
on held-out prompts, train alike at TP2 and PP2, resume exactly, run with LoRA (the reference:
the adapters off), IPO and RPO, equal TRL's DPOTrainer, and refuse bad settings in one line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

# The families register the tensor shapes the portable file checks compare weights with.
import launcher_scripts.families  # noqa: F401
from launcher_scripts.formats import portable
from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.sample_data.make_preference_pairs import follows_rule
from tests.support import REPO
from tests.support.commands import module_report, one_error_line, run_main, run_module
from tests.support.run_logs import job_log, metric

STAGE = "dpo"
VALIDATION = REPO / "launcher_scripts" / "sample_data" / "preference_validation.jsonl"


def overrides(results: Path, base: Path, *extra: str) -> list[str]:
    return [
        f"stages=[{STAGE}]",
        f"base_results_dir={results}",
        f"{STAGE}.model.pretrained_checkpoint.restore_from_path={base}",
        *extra,
    ]


def run_stage(results: Path, base: Path, *extra: str) -> Path:
    """The stage's results folder, once the run succeeded."""
    result = run_main(*overrides(results, base, *extra))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return results / "gpt3_tiny" / STAGE / "results"


def rule_share(model: Path) -> float:
    """The share of held-out prompts whose greedy answer follows the rule."""
    prompts = [json.loads(line)["prompt"] for line in VALIDATION.read_text().splitlines()]
    with tempfile.TemporaryDirectory() as scratch:
        listed = Path(scratch) / "prompts.json"
        listed.write_text(json.dumps(prompts))
        result = run_module("tests.scripts.generate_text", str(model), str(listed), "3")
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    return sum(map(follows_rule, answers)) / len(answers)


@pytest.fixture(scope="module")
def tuned(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped recipe as it is, with the held-out pairs as its test set too."""
    results = tmp_path_factory.mktemp("dpo")
    return run_stage(results, tiny_portable, f"{STAGE}.model.data.data_prefix.test=[{VALIDATION}]")


def test_dpo_raises_the_margin_and_the_policy_follows_the_rule(
    tuned: Path, tiny_portable: Path
) -> None:
    margin, accuracy = metric(tuned, "validation_margin"), metric(tuned, "validation_accuracy")
    assert margin[0] == pytest.approx(0.0, abs=1e-9)  # the policy starts as the reference
    assert 0 < margin[20] < margin[60] and accuracy[60] >= 0.9, (margin, accuracy)
    assert rule_share(tiny_portable) < 0.2
    assert rule_share(tuned / "checkpoints" / "megatron_gpt_dpo.nemo") >= 0.8
    test = json.loads((tuned / "test_metrics.json").read_text())
    assert test["margin"] == pytest.approx(margin[60], rel=1e-6)
    assert (tuned / "dpo_curves.png").stat().st_size > 0


def test_the_test_log_probabilities_give_the_logged_rewards(tuned: Path) -> None:
    """test_logps.jsonl holds each pair's tokens and both models' log-probabilities; beta
    times their differences are the rewards test_metrics.json reports."""
    rows = [json.loads(line) for line in (tuned / "test_logps.jsonl").read_text().splitlines()]
    test = json.loads((tuned / "test_metrics.json").read_text())
    beta = 0.1
    chosen = [beta * (row["policy"][0] - row["reference"][0]) for row in rows]
    rejected = [beta * (row["policy"][1] - row["reference"][1]) for row in rows]
    assert sum(chosen) / len(rows) == pytest.approx(test["rewards_chosen"], rel=1e-6)
    assert sum(rejected) / len(rows) == pytest.approx(test["rewards_rejected"], rel=1e-6)
    assert all(row["chosen_ids"][-1] == row["rejected_ids"][-1] for row in rows)  # the EOD


@pytest.mark.parametrize(
    ("loss", "trl_types", "trl_weights"),
    [
        (f"{STAGE}.model.dpo.preference_loss=sigmoid", "sigmoid", "1"),
        (f"{STAGE}.model.dpo.preference_loss=ipo", "ipo", "1"),
        # RPO: TRL's SFT term is the chosen tokens' mean over the batch, ours each answer's
        # mean (the RPO paper's); the sample answers are all one length, where they agree.
        (f"{STAGE}.model.dpo.sft_loss_weight=1.0", "sigmoid,sft", "1,1"),
    ],
    ids=["sigmoid", "ipo", "rpo"],
)
def test_each_loss_trains_and_equals_trl_s(
    loss: str,
    trl_types: str,
    trl_weights: str,
    tuned: Path,
    tiny_portable: Path,
    tmp_path: Path,
) -> None:
    """Ten steps from the tuned policy against the base as `reference_model` lower the
    validation loss; then TRL's DPOTrainer (fp32) on the policy they wrote and the same
    reference, exported to Hugging Face, over the same token ids, gives our test loss, rewards
    and log-probabilities to 1e-5."""
    folder = run_stage(
        tmp_path / "run",
        tuned / "checkpoints" / "megatron_gpt_dpo.nemo",
        loss,
        f"{STAGE}.model.dpo.reference_model={tiny_portable}",
        f"{STAGE}.model.data.data_prefix.test=[{VALIDATION}]",
        f"{STAGE}.trainer.max_steps=10",
        f"{STAGE}.trainer.val_check_interval=10",
        f"{STAGE}.model.optim.lr=1e-4",
    )
    losses = metric(folder, "validation_loss")
    assert losses[10] < losses[0], losses
    if "sft_loss_weight" in loss:  # the SFT term raises the chosen answers' likelihood
        chosen = metric(folder, "validation_logps_chosen")
        assert chosen[10] > chosen[0], chosen
    ours = json.loads((folder / "test_metrics.json").read_text())
    theirs = module_report(
        "tests.scripts.dpo_trl_check",
        str(folder / "checkpoints" / "megatron_gpt_dpo.nemo"),
        str(tiny_portable),
        str(folder / "test_logps.jsonl"),
        str(tmp_path / "trl"),
        "0.1",
        trl_types,
        trl_weights,
    )
    pairs = {
        "loss": "loss",
        "rewards_chosen": "rewards/chosen",
        "rewards_rejected": "rewards/rejected",
        "margin": "rewards/margins",
        "accuracy": "rewards/accuracies",
        "logps_chosen": "logps/chosen",
        "logps_rejected": "logps/rejected",
    }
    for mine, trl in pairs.items():
        assert ours[mine] == pytest.approx(theirs[trl], abs=1e-5), (mine, ours, theirs)
    # Not the trivial case of a policy equal to its reference (every ratio 0).
    assert abs(ours["rewards_chosen"]) + abs(ours["rewards_rejected"]) > 0.5, ours


# ---- layouts and resume ---------------------------------------------------------------------

SHORT = (
    f"{STAGE}.trainer.max_steps=20",
    f"{STAGE}.trainer.log_every_n_steps=5",
    f"{STAGE}.trainer.val_check_interval=100",
    f"{STAGE}.model.optim.sched.min_lr=3e-4",  # a constant rate after warm-up: resumable
)


@pytest.fixture(scope="module")
def short_run(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_stage(tmp_path_factory.mktemp("dpo_short"), tiny_portable, *SHORT)


@pytest.mark.parametrize(
    "layout",
    [
        ("tensor_model_parallel_size=2", "sequence_parallel=True"),
        ("pipeline_model_parallel_size=2",),
    ],
    ids=["tp2_sp", "pp2"],
)
def test_two_process_layouts_train_like_one_process(
    layout: tuple[str, ...], short_run: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    parallel = run_stage(
        tmp_path,
        tiny_portable,
        *SHORT,
        f"{STAGE}.trainer.devices=2",
        *(f"{STAGE}.model.{setting}" for setting in layout),
    )
    mine, reference = (metric(d, "reduced_train_loss") for d in (parallel, short_run))
    assert sorted(mine) == [5, 10, 15, 20]
    for step, loss in mine.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), (step, mine, reference)


def test_a_longer_rerun_resumes_exactly(
    short_run: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    """10 steps, then the same command with max_steps 20: the reference's log-probabilities
    are read back, not computed from the resumed policy, and steps 15 and 20 are the
    uninterrupted run's."""
    run_stage(tmp_path, tiny_portable, *SHORT[1:], f"{STAGE}.trainer.max_steps=10")
    resumed = run_stage(tmp_path, tiny_portable, *SHORT)
    assert "reference log-probabilities: read back" in job_log(resumed)
    mine, reference = (metric(d, "reduced_train_loss") for d in (resumed, short_run))
    assert sorted(mine) == [5, 10, 15, 20]
    for step in (15, 20):
        assert mine[step] == pytest.approx(reference[step], rel=1e-6), (step, mine, reference)


def test_lora_dpo_starts_at_the_reference_and_writes_a_peft_file(
    tiny_portable: Path, tmp_path: Path
) -> None:
    folder = run_stage(
        tmp_path,
        tiny_portable,
        f"{STAGE}.model.peft.peft_scheme=lora",
        f"{STAGE}.trainer.max_steps=40",
        f"{STAGE}.model.optim.lr=2e-3",
    )
    margin = metric(folder, "validation_margin")
    assert margin[0] == pytest.approx(0.0, abs=1e-9) and margin[40] > 0.5, margin
    output = folder / "checkpoints" / "megatron_gpt_dpo.nemo"
    assert peft_file.is_peft_file(output)
    assert peft_file.read(output).settings.scheme == "lora"


def test_packed_pairs_see_only_themselves_and_learn(tiny_portable: Path, tmp_path: Path) -> None:
    """Packed rows (three or four pairs each, every side its own segment): the first step's
    loss is log 2 to 1e-5, so each side's log-probability in a packed row is the one the
    unpacked reference pass computed (no side sees another); then the margin rises."""
    import math

    folder = run_stage(
        tmp_path,
        tiny_portable,
        f"{STAGE}.model.data.packed_sequence=True",
        f"{STAGE}.model.data.seq_length=128",
        f"{STAGE}.model.global_batch_size=4",  # packed sequences, not pairs
        f"{STAGE}.model.micro_batch_size=2",
        f"{STAGE}.trainer.max_steps=20",
        f"{STAGE}.trainer.log_every_n_steps=1",
        f"{STAGE}.trainer.val_check_interval=20",
    )
    losses = metric(folder, "reduced_train_loss")
    assert losses[1] == pytest.approx(math.log(2), abs=1e-5), losses
    margin = metric(folder, "validation_margin")
    assert margin[20] > margin[0] + 0.1, margin


# ---- bad input ------------------------------------------------------------------------------


def _variant(base: Path, folder: Path, change: Any) -> Path:
    """A copy of the base file changed by `change(config, tokenizer_file)`."""
    with tempfile.TemporaryDirectory() as scratch:
        model = portable.read(base, Path(scratch))
        tensors = {key: model.tensors[key] for key in list(model.tensors.keys())}
        tokenizer = Path(str(model.config.tokenizer.model))
        copy = folder / f"changed_{tokenizer.name}"
        shutil.copy(tokenizer, copy)
        model.config.tokenizer.model = str(copy)
        change(model.config, copy)
        path = folder / "variant.nemo"
        portable.write(path, model.config, tensors)
    return path


def _other_activation(config: Any, tokenizer: Path) -> None:
    del tokenizer
    config.activation = "squared-relu"


def _other_tokenizer(config: Any, tokenizer: Path) -> None:
    del config
    with tokenizer.open("ab") as end:
        end.write(b"\0")


@pytest.mark.parametrize(
    ("change", "fragment"),
    [(_other_activation, "activation"), (_other_tokenizer, "different tokenizers")],
    ids=["architecture", "tokenizer"],
)
def test_a_reference_unlike_the_policy_is_one_line(
    change: Any, fragment: str, tiny_portable: Path, tmp_path: Path
) -> None:
    reference = _variant(tiny_portable, tmp_path, change)
    result = run_main(
        *overrides(tmp_path, tiny_portable, f"{STAGE}.model.dpo.reference_model={reference}")
    )
    one_error_line(result, f"{STAGE}.model.dpo.reference_model", fragment)
    assert not (tmp_path / "gpt3_tiny").exists()


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (f"{STAGE}.model.dpo.ref_policy_kl_penalty=0", ["ref_policy_kl_penalty", "above 0"]),
        (f"{STAGE}.model.dpo.preference_loss=kto", ["preference_loss", "sigmoid, ipo"]),
        (f"{STAGE}.model.dpo.label_smoothing=0.6", ["label_smoothing", "[0, 0.5)"]),
        (f"{STAGE}.model.data.packed_sequence=True {STAGE}.model.micro_batch_size=1",
         ["micro_batch_size", "even"]),
    ],
    ids=["beta", "loss", "smoothing", "packed_odd_micro_batch"],
)  # fmt: skip
def test_bad_dpo_settings_are_one_line(
    override: str, fragments: list[str], tiny_portable: Path, tmp_path: Path
) -> None:
    one_error_line(run_main(*overrides(tmp_path, tiny_portable, *override.split())), *fragments)
