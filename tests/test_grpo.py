"""Group-relative policy optimisation (the grpo stage) on the tiny model, end to end through
main.py.

The shipped recipes: fine_tuning=gpt3/tiny teaches the tiny GPT to answer the sample prompts
with a time (any of four alike), then grpo=gpt3/tiny rewards completions that name a morning
time (the shipped regular-expression reward). GRPO must raise the reward of its own rollouts and
of the held-out prompts' greedy answers; its loss must be TRL's; a resumed run must continue the
same run (rollouts, the saved rollout batch of num_iterations > 1, the KL to the reference); a
TP2 policy must train as TP1; bad settings and bad reward functions stop in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.jobs.fine_tuning.grpo import advantages
from launcher_scripts.recipes.rewards import exact_answer, final_answer, matches_format
from launcher_scripts.sample_data.make_preference_pairs import follows_rule
from tests.support import REPO
from tests.support.commands import module_report, one_error_line, run_main
from tests.support.run_logs import job_log, metric

STAGE = "grpo"
VALIDATION = REPO / "launcher_scripts" / "sample_data" / "preference_validation.jsonl"
CONSTANT_LR = (
    f"{STAGE}.model.optim.sched.min_lr=5e-4",
    f"{STAGE}.model.optim.sched.warmup_steps=0",
)


def overrides(results: Path, base: Path, *extra: str) -> list[str]:
    return [
        f"stages=[{STAGE}]",
        f"base_results_dir={results}",
        f"{STAGE}.model.pretrained_checkpoint.restore_from_path={base}",
        *extra,
    ]


def run_stage(results: Path, base: Path, *extra: str, **options: Any) -> Path:
    """The stage's results folder, once the run succeeded."""
    result = run_main(*overrides(results, base, *extra), **options)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return results / "gpt3_tiny" / STAGE / "results"


@pytest.fixture(scope="module")
def tuned(sft_start: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped recipe as it is, with the held-out prompts as its test set too."""
    results = tmp_path_factory.mktemp("grpo")
    return run_stage(results, sft_start, f"{STAGE}.model.data.data_prefix.test=[{VALIDATION}]")


def test_grpo_raises_the_reward_of_rollouts_and_held_out_prompts(tuned: Path) -> None:
    """Measured: held-out reward 0.0 at step 0 and 1.0 from step 20; rollouts ~0.5 at the
    first steps and above 0.95 from step 20."""
    held_out = metric(tuned, "validation_reward")
    assert held_out[0] <= 0.25 and held_out[40] >= 0.8, held_out
    rewards = metric(tuned, "reward")
    assert sorted(rewards) == list(range(1, 41))
    first, last = [rewards[s] for s in (1, 2, 3)], [rewards[s] for s in range(36, 41)]
    assert sum(last) / 5 >= sum(first) / 3 + 0.3, rewards
    # One optimizer step per rollout batch: the ratio is 1, nothing is clipped.
    assert set(metric(tuned, "clip_ratio").values()) == {0.0}
    shares = metric(tuned, "generation_share")
    assert all(0 < share < 1 for share in shares.values()), shares
    for name in ("reward_std", "completion_length", "truncated_share", "rewards/matches_format"):
        assert len(metric(tuned, name)) == 40, name
    test = json.loads((tuned / "test_metrics.json").read_text())
    assert test["reward"] == pytest.approx(held_out[40])  # greedy on the same prompts
    lines = (tuned / "test_completions.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 128 and all(set(row) >= {"prompt", "completion", "reward"} for row in rows)
    assert (tuned / "grpo_curves.png").stat().st_size > 0
    assert (tuned / "checkpoints" / "megatron_gpt_grpo.nemo").stat().st_size > 0


def test_the_loss_is_trl_s() -> None:
    """TRL's GRPOTrainer._compute_loss on the same log-probabilities, old and reference
    log-probabilities, advantages and masks: each loss type, with and without the KL term and
    an asymmetric clip, gives the same loss and gradient."""
    report = module_report("tests.scripts.grpo_trl_check")
    assert len(report) == 6
    for case, found in report.items():
        assert found["magnitude"] > 0.1, case
        assert found["loss"] < 1e-5 and found["grad"] < 1e-6, (case, found)


def test_a_resumed_run_continues_the_same_run(sft_start: Path, tmp_path: Path) -> None:
    """Two optimizer steps per rollout batch and a KL term: 3 steps, then the same command
    with max_steps 6, resumes mid-batch (its rollouts read back from rollouts.pt) and logs
    what the uninterrupted run logs."""
    common = (
        *CONSTANT_LR,
        f"{STAGE}.model.grpo.num_iterations=2",
        f"{STAGE}.model.grpo.beta=0.04",
        f"{STAGE}.trainer.val_check_interval=100",
        f"{STAGE}.model.data.data_prefix.validation=null",
    )
    whole = run_stage(tmp_path / "whole", sft_start, *common, f"{STAGE}.trainer.max_steps=6")
    run_stage(tmp_path / "parts", sft_start, *common, f"{STAGE}.trainer.max_steps=3")
    parts = run_stage(tmp_path / "parts", sft_start, *common, f"{STAGE}.trainer.max_steps=6")
    assert "resumed from" in job_log(parts) and (parts / "rollouts.pt").is_file()
    for name in ("reward", "kl", "clip_ratio", "completion_length"):
        mine, reference = metric(parts, name), metric(whole, name)
        assert sorted(mine) == list(range(1, 7)), (name, mine)
        for step in range(4, 7):
            assert mine[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-9), (name, step)
    kl = metric(whole, "kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-9) and kl[6] > 0  # the policy leaves the start
    assert max(metric(whole, "clip_ratio").values()) > 0  # the second step of a batch clips


SHORT = (
    *CONSTANT_LR,
    f"{STAGE}.trainer.max_steps=4",
    f"{STAGE}.trainer.log_every_n_steps=2",
    f"{STAGE}.trainer.val_check_interval=100",
    f"{STAGE}.model.data.data_prefix.validation=null",
)


@pytest.fixture(scope="module")
def short_run(sft_start: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_stage(tmp_path_factory.mktemp("grpo_short"), sft_start, *SHORT)


@pytest.mark.parametrize(
    "layout",
    ["tensor_model_parallel_size=2", "pipeline_model_parallel_size=2"],
    ids=["tp2", "pp2"],
)
def test_a_model_parallel_policy_trains_as_one_process(
    layout: str, short_run: Path, sft_start: Path, tmp_path: Path
) -> None:
    """The same rollouts (every rank of the replica samples the same tokens, as one process
    does) and the same losses."""
    two = run_stage(
        tmp_path, sft_start, *SHORT, f"{STAGE}.trainer.devices=2", f"{STAGE}.model.{layout}"
    )
    assert metric(two, "reward") == metric(short_run, "reward")
    assert metric(two, "completion_length") == metric(short_run, "completion_length")
    losses, reference = metric(two, "reduced_train_loss"), metric(short_run, "reduced_train_loss")
    assert sorted(losses) == [2, 4]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-4, abs=1e-6), (step, losses)


def test_two_data_parallel_replicas_share_the_rollouts(sft_start: Path, tmp_path: Path) -> None:
    """Each replica samples half of a step's completions, with its own seed, and both train
    on all of them: the step's metrics (reduced over the replicas) cover every completion."""
    two = run_stage(tmp_path, sft_start, *SHORT, f"{STAGE}.trainer.devices=2")
    lengths = metric(two, "completion_length")
    assert sorted(lengths) == [1, 2, 3, 4] and all(length > 0 for length in lengths.values())
    log = job_log(two)
    assert "8 prompts per rollout batch, 8 completions each" in log
    assert "rank 1: grpo (every weight)" in log


def test_lora_grpo_writes_the_peft_file_and_its_reference_is_the_base(
    sft_start: Path, tmp_path: Path
) -> None:
    """LoRA's adapters start at zero, so the starting policy (the KL's reference, the adapters
    at their start) is the base: the KL is 0 at the first step, above 0 once they learn."""
    tuned = run_stage(
        tmp_path,
        sft_start,
        *CONSTANT_LR,
        f"{STAGE}.model.peft.peft_scheme=lora",
        f"{STAGE}.model.grpo.beta=0.04",
        f"{STAGE}.trainer.max_steps=4",
        f"{STAGE}.trainer.val_check_interval=100",
        f"{STAGE}.model.data.data_prefix.validation=null",
    )
    kl = metric(tuned, "kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-9) and kl[4] > 0, kl
    output = tuned / "checkpoints" / "megatron_gpt_grpo.nemo"
    assert peft_file.is_peft_file(output)
    assert peft_file.read(output).settings.scheme == "lora"


def test_grpo_with_the_reward_model(
    sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """The reward model the rlhf_rm stage trained on the sample pairs (which prefer morning
    times) as the only reward, standardised with its file's mean and std: the held-out
    answers' reward rises, and they come to name morning times."""
    model = tiny_reward_model / "checkpoints" / "megatron_gpt_reward_model.nemo"
    tuned = run_stage(
        tmp_path,
        sft_start,
        f"{STAGE}.model.grpo.reward_functions=[{{reward_model: {model}}}]",
        f"{STAGE}.trainer.max_steps=20",
    )
    held_out = metric(tuned, "validation_reward")
    assert held_out[20] >= held_out[0] + 1.0, held_out  # in the reward model's std units
    assert len(metric(tuned, "rewards/reward_model")) == 20
    lines = (tuned / "validation_completions.jsonl").read_text().splitlines()
    answers = [json.loads(line)["completion"] for line in lines]
    assert sum(map(follows_rule, answers)) / len(answers) >= 0.8, answers[:8]
    assert f"reward model {model}" in job_log(tuned)


def test_a_reward_model_must_be_one_and_share_the_policy_s_tokenizer(
    tiny_portable: Path, t5_converted: Path, tmp_path: Path
) -> None:
    key = f"{STAGE}.model.grpo.reward_functions[0].reward_model"
    t5 = t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"
    for model, fragment in ((t5, "hold different tokenizers"), (tiny_portable, "not a reward")):
        result = run_main(
            *overrides(
                tmp_path,
                tiny_portable,
                f"{STAGE}.model.grpo.reward_functions=[{{reward_model: {model}}}]",
            )
        )
        one_error_line(result, key, fragment)
    assert not (tmp_path / "gpt3_tiny").exists()


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (f"{STAGE}.model.grpo.num_generations=1", ["num_generations: 1", "2 or more"]),
        (f"{STAGE}.model.global_batch_size=60", ["global_batch_size: 60", "multiple of 8"]),
        (f"{STAGE}.model.grpo.beta=-0.1", ["beta: -0.1"]),
        (f"{STAGE}.model.grpo.loss_type=ppo", ["loss_type: 'ppo'", "dapo, grpo, dr_grpo"]),
        (f"{STAGE}.model.grpo.temperature=0", ["temperature: 0.0", "above 0"]),
        (
            f"{STAGE}.model.grpo.reward_functions=[nosuch_module_here:score]",
            ["reward_functions[0].function", "'nosuch_module_here' is not importable"],
        ),
        (
            f"{STAGE}.model.grpo.reward_functions=[launcher_scripts.recipes.rewards]",
            ["reward_functions[0].function", "module:function"],
        ),
        (
            f"{STAGE}.model.grpo.reward_functions=[launcher_scripts.recipes.rewards:nothing]",
            ["reward_functions[0].function", "AttributeError"],
        ),
        (f"{STAGE}.model.grpo.reward_functions=[]", ["reward_functions", "at least one"]),
    ],
    ids=[
        "one-generation",
        "partial-groups",
        "negative-beta",
        "loss-type",
        "greedy-rollouts",
        "missing-module",
        "no-function",
        "unknown-function",
        "no-rewards",
    ],
)
def test_bad_settings_are_one_line_before_anything_runs(
    override: str, fragments: list[str], tiny_portable: Path, tmp_path: Path
) -> None:
    one_error_line(run_main(*overrides(tmp_path, tiny_portable, override)), *fragments)
    assert not (tmp_path / "gpt3_tiny").exists()


def test_a_bad_prompt_record_is_one_line_before_anything_runs(
    tiny_portable: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "A river"}\n{"question": "no prompt"}\n')
    result = run_main(
        *overrides(tmp_path, tiny_portable, f"{STAGE}.model.data.data_prefix.train=[{prompts}]")
    )
    one_error_line(result, f"{prompts}:2", "'prompt' missing")


REWARDS = """
def raises(prompt, completion, **fields):
    raise ValueError("cannot score this")


def words(prompt, completion, **fields):
    return "high"
"""


@pytest.mark.parametrize(
    ("function", "fragments"),
    [
        ("raises", ["user_rewards:raises raised ValueError: cannot score this", "preference_"]),
        ("words", ["user_rewards:words returned 'high'", "a finite number"]),
    ],
)
def test_a_reward_function_that_fails_stops_the_run_in_one_line(
    function: str, fragments: list[str], tiny_portable: Path, tmp_path: Path
) -> None:
    """A user's function on PYTHONPATH: found at preflight, then at the first rollout it
    raises, or returns no number: the job stops naming the function and the record."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    result = run_main(
        *overrides(
            tmp_path / "results",
            tiny_portable,
            f"{STAGE}.model.grpo.reward_functions=[user_rewards:{function}]",
            f"{STAGE}.model.data.data_prefix.validation=null",
        ),
        extra_env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in job_log(
        tmp_path / "results" / "gpt3_tiny" / STAGE / "results"
    )
    log = job_log(tmp_path / "results" / "gpt3_tiny" / STAGE / "results")
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(f in errors[0] for f in fragments), log[-3000:]


def test_group_advantages() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    group = advantages(rewards, 4, "group")
    # The first group's lone success is 1.5 standard deviations above its mean (unbiased std
    # 0.5); a group of equal rewards teaches nothing.
    assert group[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-3)
    assert group[4:].tolist() == [0.0] * 4
    assert advantages(rewards, 4, "none")[:4].tolist() == [0.75, -0.25, -0.25, -0.25]
    batch = advantages(rewards, 4, "batch")
    assert batch[0] == pytest.approx(0.75 / float(rewards.std()), rel=1e-3)


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        (" 7", "7", 1.0),
        (" The sum is 7.", "7", 1.0),
        (" so 3 + 4 = \\boxed{7}", "7", 1.0),
        (" steps... #### 1,234", "1234", 1.0),
        (" 7.0", "7", 1.0),
        (" 8", "7", 0.0),
        (" seven", "7", 0.0),
        (" 17", "7", 0.0),
    ],
)
def test_exact_answer(completion: str, answer: str, reward: float) -> None:
    assert exact_answer("3 plus 4 is", completion, answer=answer) == reward


def test_final_answer_and_format() -> None:
    assert final_answer(" no number here") is None
    assert matches_format("p", " dawn.", pattern=r"(dawn|noon)\b.*") == 1.0
    assert matches_format("p", " dusk. dawn", pattern=r"(dawn|noon)\b.*") == 0.0
    with pytest.raises(ValueError, match="kwargs"):
        matches_format("p", "x")
