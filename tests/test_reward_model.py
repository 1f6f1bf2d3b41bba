"""Reward-model training (the rlhf_rm stage) on the tiny model, end to end through main.py.

The preference pairs (launcher_scripts/sample_data/make_preference_pairs.py) follow a known
rule the base model has no reason to prefer: the chosen answer names a morning time, the
rejected one an evening time. The reward model must rank held-out pairs by it, write its head
and the rewards' mean and std with the model, train alike at TP2 and PP2, resume exactly, and
refuse bad input in one line.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest

# The families register the tensor shapes the portable file checks compare weights with.
import launcher_scripts.families  # noqa: F401
from launcher_scripts.formats import portable
from launcher_scripts.formats.portable import REWARD_HEAD, REWARD_MODEL
from tests.support import REPO
from tests.support.commands import one_error_line, run_main


def run_module_unchecked(*args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


STAGE = "rlhf_rm"
SAMPLES = REPO / "launcher_scripts" / "sample_data"
VALIDATION = SAMPLES / "preference_validation.jsonl"


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


def records(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def metric(log_dir: Path, name: str) -> dict[int, float]:
    return {r["step"]: r[name] for r in records(log_dir) if name in r}


@pytest.fixture(scope="module")
def trained(tiny_reward_model: Path) -> Path:
    """The shipped recipe as it is, with the held-out pairs as its test set too (shared with
    the GRPO tests, which score with it)."""
    return tiny_reward_model


def test_the_reward_model_ranks_held_out_pairs_by_the_rule(trained: Path) -> None:
    accuracy = metric(trained, "validation_accuracy")
    losses = metric(trained, "validation_loss")
    # The head starts at zero: every pair ties, at the loss of a coin toss.
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert accuracy[100] >= 0.9 and losses[100] < 0.3, (accuracy, losses)
    test = json.loads((trained / "test_metrics.json").read_text())
    assert test["accuracy"] == pytest.approx(accuracy[100], abs=1e-9)
    assert test["rewards_chosen"] > test["rewards_rejected"]


def test_the_file_holds_the_head_and_the_rewards_mean_and_std(trained: Path) -> None:
    path = trained / "checkpoints" / "megatron_gpt_reward_model.nemo"
    with tempfile.TemporaryDirectory() as scratch:
        model = portable.read(path, Path(scratch))
        assert tuple(model.tensors.shape(REWARD_HEAD)) == (1, int(model.config.hidden_size))
        assert "output_layer.weight" not in list(model.tensors.keys())
        standardization = model.config[REWARD_MODEL]
    mean, std = metric(trained, "validation_reward_mean"), metric(trained, "validation_reward_std")
    assert standardization.mean == pytest.approx(mean[100], rel=1e-9)
    assert standardization.std == pytest.approx(std[100], rel=1e-9)
    assert standardization.std > 0.1


def test_transformers_scores_the_export_as_we_do(trained: Path) -> None:
    """The Hugging Face export is the architecture's sequence classifier: transformers gives
    each test text our reward (padded rows in one batch, as users batch them), and the
    pairwise loss of its rewards is our test loss."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(trained / "hf_reward_model")
    assert type(model).__name__ == "GPT2ForSequenceClassification"
    rows = [json.loads(line) for line in (trained / "test_rewards.jsonl").read_text().splitlines()]
    texts = [row["chosen_ids"] for row in rows] + [row["rejected_ids"] for row in rows]
    ours = torch.tensor([row["chosen"] for row in rows] + [row["rejected"] for row in rows])
    pad = model.config.pad_token_id
    longest = max(len(ids) for ids in texts)
    ids = torch.tensor([row + [pad] * (longest - len(row)) for row in texts])
    with torch.no_grad():
        theirs = model.eval()(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0]
    assert (theirs - ours).abs().max() <= 1e-4
    chosen, rejected = theirs[: len(rows)].double(), theirs[len(rows) :].double()
    loss = float(-torch.nn.functional.logsigmoid(chosen - rejected).mean())
    test = json.loads((trained / "test_metrics.json").read_text())
    assert loss == pytest.approx(test["loss"], rel=1e-5, abs=1e-7)


def test_the_reference_s_indexed_pairs_train_it(
    prepared: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    """The reference's layout: consecutive {"text"} lines, chosen first, through
    data_preparation's indexed files (the model's tokenizer, an end-of-document token each)."""
    lines = []
    for line in (SAMPLES / "preference_train.jsonl").read_text().splitlines():
        pair = json.loads(line)
        lines += [json.dumps({"text": pair["prompt"] + pair[k]}) for k in ("chosen", "rejected")]
    texts = tmp_path / "pairs.jsonl"
    texts.write_text("\n".join(lines) + "\n")
    tokenizer = prepared / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.model"
    result = run_main(
        "stages=[data_preparation]",
        f"base_results_dir={tmp_path}/results",
        f"data_dir={tmp_path}/data",
        "data_preparation.train_tokenizer=false",
        f"data_preparation.tokenizer_model={tokenizer}",
        f"data_preparation.raw_dataset_files=[{texts}]",
        "data_preparation.append_eod=true",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    prefix = tmp_path / "data" / "custom_dataset" / "preprocessed" / "pairs_text_document"
    folder = run_stage(
        tmp_path / "rm",
        tiny_portable,
        f"{STAGE}.model.data.data_prefix.train=[{prefix}]",
        f"{STAGE}.trainer.max_steps=40",
        f"{STAGE}.trainer.val_check_interval=40",
    )
    log = next(folder.parent.glob("log-*.out")).read_text()
    assert "training data: 640 preference pairs" in log
    assert metric(folder, "validation_accuracy")[40] >= 0.9


def _post(port: int, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_reward_server_scores_texts_as_training_did(trained: Path, tmp_path: Path) -> None:
    """serve-reward answers a batch of texts with the rewards the job computed for them,
    normalised on request by the mean and std the file records; a bad request is a 400 with
    one line, and SIGTERM stops it cleanly."""
    import re
    import signal
    import subprocess
    import sys
    import time

    from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer

    model = trained / "checkpoints" / "megatron_gpt_reward_model.nemo"
    rows = [json.loads(line) for line in (trained / "test_rewards.jsonl").read_text().splitlines()]
    rows = rows[:6]
    with tempfile.TemporaryDirectory() as scratch:
        config = portable.read(model, Path(scratch)).config
        tokenizer = load_text_tokenizer(config.tokenizer)
        texts = [
            tokenizer.decode(row[f"{side}_ids"]) for side in ("chosen", "rejected") for row in rows
        ]
        assert [tokenizer.encode(text) for text in texts[: len(rows)]] == [
            r["chosen_ids"] for r in rows
        ]
    log = tmp_path / "server.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "launcher_scripts", "serve-reward", str(model), "--port", "0"],
            stdout=output, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (found := re.search(r"127\.0\.0\.1:(\d+)/rewards", log.read_text())):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        port = int(found.group(1))
        status, answer = _post(port, "/rewards", {"texts": texts})
        assert status == 200, answer
        ours = [row["chosen"] for row in rows] + [row["rejected"] for row in rows]
        assert answer["rewards"] == pytest.approx(ours, abs=1e-5)
        status, normalized = _post(port, "/rewards", {"texts": texts, "normalize": True})
        standardization = config[REWARD_MODEL]
        expected = [(r - standardization.mean) / standardization.std for r in ours]
        assert normalized["rewards"] == pytest.approx(expected, abs=1e-4)
        status, refused = _post(port, "/rewards", {"texts": "one text"})
        assert status == 400 and "non-empty list of strings" in refused["error"], refused
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code == 0 and "stopped: the reward server has shut down" in log.read_text()


@pytest.mark.parametrize(
    "stage_overrides",
    [
        ["stages=[export]", "export.model.nemo_file={model}"],
        ["stages=[dpo]", "dpo.model.pretrained_checkpoint.restore_from_path={model}"],
    ],
    ids=["export", "dpo"],
)
def test_a_stage_that_needs_a_language_model_refuses_a_reward_model(
    stage_overrides: list[str], trained: Path, tmp_path: Path
) -> None:
    model = trained / "checkpoints" / "megatron_gpt_reward_model.nemo"
    result = run_main(
        *(o.format(model=model) for o in stage_overrides), f"base_results_dir={tmp_path}"
    )
    one_error_line(result, "is a reward model", "serve-reward")


def test_the_reward_server_refuses_a_language_model_in_one_line(tiny_portable: Path) -> None:
    result = run_module_unchecked(
        "launcher_scripts", "serve-reward", str(tiny_portable), "--port", "0"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error:")
    assert "is not a reward model" in result.stderr and "rlhf_rm" in result.stderr


def test_an_imported_llama_trains_and_exports_as_llama_for_sequence_classification(
    tmp_path: Path,
) -> None:
    """The reward model of an imported Llama (GQA, rotary, RMSNorm, SwiGLU) goes back to
    Hugging Face as LlamaForSequenceClassification, which scores our test texts as we do."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.support.commands import run_module
    from tests.support.conversion import hf_imported

    run_module("tests.scripts.make_hf_gpt", str(tmp_path / "hf"), "llama3")
    imported = hf_imported(tmp_path / "hf" / "llama3", tmp_path / "imported")
    folder = run_stage(
        tmp_path / "rm",
        imported,
        f"{STAGE}.trainer.max_steps=10",
        f"{STAGE}.trainer.val_check_interval=10",
        f"{STAGE}.model.data.data_prefix.test=[{VALIDATION}]",
    )
    exported = folder / "hf_reward_model"
    model = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    rows = [json.loads(line) for line in (folder / "test_rewards.jsonl").read_text().splitlines()]
    worst = 0.0
    with torch.no_grad():
        for row in rows[:16]:
            for side in ("chosen", "rejected"):
                logits = model(input_ids=torch.tensor([row[f"{side}_ids"]])).logits
                worst = max(worst, abs(float(logits[0, 0]) - row[side]))
    assert worst <= 1e-4


# ---- layouts and resume ---------------------------------------------------------------------

SHORT = (
    f"{STAGE}.trainer.max_steps=20",
    f"{STAGE}.trainer.log_every_n_steps=5",
    f"{STAGE}.trainer.val_check_interval=100",
    f"{STAGE}.model.optim.sched.min_lr=3e-4",  # a constant rate after warm-up: resumable
)


@pytest.fixture(scope="module")
def short_run(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_stage(tmp_path_factory.mktemp("rm_short"), tiny_portable, *SHORT)


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
    """10 steps, then the same command with max_steps 20: it resumes from step 10 and its
    steps 15 and 20 are the uninterrupted run's."""
    shorter = [*SHORT[1:], f"{STAGE}.trainer.max_steps=10"]
    run_stage(tmp_path, tiny_portable, *shorter)
    resumed = run_stage(tmp_path, tiny_portable, *SHORT)
    mine, reference = (metric(d, "reduced_train_loss") for d in (resumed, short_run))
    assert sorted(mine) == [5, 10, 15, 20]
    for step in (15, 20):
        assert mine[step] == pytest.approx(reference[step], rel=1e-6), (step, mine, reference)


def test_lora_reward_model_learns_and_writes_a_whole_model(
    tiny_portable: Path, tmp_path: Path
) -> None:
    folder = run_stage(
        tmp_path,
        tiny_portable,
        f"{STAGE}.model.peft.peft_scheme=lora",
        f"{STAGE}.trainer.max_steps=60",
        f"{STAGE}.trainer.val_check_interval=60",
        f"{STAGE}.model.optim.lr=3e-3",
    )
    assert metric(folder, "validation_accuracy")[60] >= 0.9
    with tempfile.TemporaryDirectory() as scratch:
        path = folder / "checkpoints" / "megatron_gpt_reward_model.nemo"
        model = portable.read(path, Path(scratch))
        keys = list(model.tensors.keys())
    assert REWARD_HEAD in keys and not [k for k in keys if "lora" in k], keys


# ---- bad input ------------------------------------------------------------------------------


def _pairs_file(tmp_path: Path, *records: dict[str, Any]) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = {"prompt": "A noun before", "chosen": " dawn.", "rejected": " dusk."}


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ({"prompt": "A noun before", "chosen": " dawn."}, "'rejected' missing"),
        ({"prompt": "A noun before", "chosen": " dawn.", "rejected": "dawn."}, "same text"),
        ({"prompt": [{"role": "assistant", "content": "hi"}], "chosen": "a", "rejected": "b"},
         "must end with a user turn"),
    ],
    ids=["no_rejected", "chosen_is_rejected", "chat_ends_with_assistant"],
)  # fmt: skip
def test_a_bad_preference_record_is_one_line_before_anything_runs(
    bad: dict[str, Any], fragment: str, tiny_portable: Path, tmp_path: Path
) -> None:
    data = _pairs_file(tmp_path, GOOD, bad)
    result = run_main(
        *overrides(tmp_path, tiny_portable, f"{STAGE}.model.data.data_prefix.train=[{data}]")
    )
    one_error_line(result, f"{STAGE}.model.data.data_prefix.train[0]", f"{data}:2", fragment)
    assert not (tmp_path / "gpt3_tiny").exists()


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (f"{STAGE}.model.peft.peft_scheme=ptuning",
         [f"{STAGE}.model.peft.peft_scheme", "does not fold into the weights", "lora"]),
        (f"{STAGE}.model.data.data_prefix=null",
         [f"{STAGE}.model.data.data_prefix", "{train: [files]"]),
        (f"{STAGE}.model.data.seq_length=4096", [f"{STAGE}.model.data.seq_length", "positions"]),
        (f"{STAGE}.model.data.packed_sequence=True",
         [f"{STAGE}.model.data.packed_sequence", "does not pack"]),
    ],
    ids=["unmerged_method", "prefix_list", "too_long", "packed"],
)  # fmt: skip
def test_bad_reward_model_settings_are_one_line(
    override: str, fragments: list[str], tiny_portable: Path, tmp_path: Path
) -> None:
    one_error_line(run_main(*overrides(tmp_path, tiny_portable, override)), *fragments)


def test_a_prompt_with_no_room_for_an_answer_stops_the_job_in_one_line(
    tiny_portable: Path, tmp_path: Path
) -> None:
    long_prompt = {**GOOD, "prompt": " ".join(["before"] * 80)}
    data = _pairs_file(tmp_path, GOOD, long_prompt)
    result = run_main(
        *overrides(
            tmp_path,
            tiny_portable,
            f"{STAGE}.model.data.data_prefix.train=[{data}]",
            f"{STAGE}.model.data.data_prefix.validation=null",
        )
    )
    assert result.returncode != 0
    log = next((tmp_path / "gpt3_tiny" / STAGE).glob("log-*.out")).read_text()
    lines = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"{data}:2" in lines[0] and "no room for an answer" in lines[0], log
    assert "Traceback" not in log
