"""PPO (the rlhf_ppo stage, reference 5.16.2) on the tiny model, end to end through main.py.

The shipped recipes: fine_tuning=gpt3/tiny teaches the tiny GPT to answer the sample prompts
with a time (any of four alike), rlhf_rm=gpt3/tiny trains the reward model on the sample pairs
(which prefer morning times), then rlhf_ppo=gpt3/tiny trains the actor against it with the
critic started from it. PPO must raise the reward of its own rollouts and of the held-out
prompts' greedy answers while its KL to the initial policy stays bounded; a resumed run must
continue the same run (the critic, the adaptive KL coefficient and a rollout batch trained on
over several steps); a TP2 actor and critic must train as TP1; bad settings stop in one line.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher_scripts.formats import portable
from launcher_scripts.formats.portable import REWARD_MODEL
from launcher_scripts.jobs.fine_tuning import peft_file
from launcher_scripts.jobs.fine_tuning.ppo import adapted_coefficient, gae
from tests.support import REPO
from tests.support.commands import one_error_line, run_main
from tests.support.ppo import (
    CONSTANT_LR,
    NO_VALIDATION,
    ROLES,
    SERVED,
    SHORT,
    STAGE,
    TRAIN,
    metric_lines,
    overrides,
    reward_model,
)
from tests.support.run_logs import job_log, metric


def run_stage(results: Path, base: Path, scorer: Path, *extra: str) -> Path:
    """The stage's results folder, once the run succeeded."""
    result = run_main(*overrides(results, base, scorer, *extra))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return results / "gpt3_tiny" / STAGE / "results"


@pytest.fixture(scope="module")
def trained(
    sft_start: Path, tiny_reward_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The shipped recipe as it is (40 steps: 20 rollout batches of 64, two steps each)."""
    results = tmp_path_factory.mktemp("ppo")
    return run_stage(results, sft_start, reward_model(tiny_reward_model))


def test_ppo_raises_the_reward_while_the_kl_stays_bounded(trained: Path) -> None:
    """Measured: the rollouts' mean reward (the reward model's, standardised) 0.00 at the
    first batch, 0.92 to 1.00 over the last five; the held-out greedy answers' -1.00 -> 1.00;
    the KL to the initial policy at most 1.12 nats a completion; the value loss 1.65 -> 0.02."""
    rewards = metric(trained, "reward")
    assert sorted(rewards) == list(range(1, 41))
    late = [rewards[step] for step in range(31, 41, 2)]
    assert sum(late) / len(late) >= rewards[1] + 0.5, rewards
    kl = metric(trained, "kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-6) and max(kl.values()) < 2.5, kl
    held_out = metric(trained, "validation_reward")
    assert held_out[40] >= held_out[0] + 1.0, held_out
    value_loss = metric(trained, "value_loss")
    assert value_loss[40] < value_loss[1] / 4, value_loss
    for name in ("entropy", "clip_ratio", "approx_kl", "kl_coef", "generation_share", "returns"):
        assert len(metric(trained, name)) == 40, name
    checkpoints = trained / "checkpoints"
    assert (checkpoints / "megatron_gpt_ppo_actor.nemo").is_file()
    critic = portable.read(checkpoints / "critic.nemo", trained / "critic_read", extract=False)
    assert REWARD_MODEL in critic.config  # the next run's critic, a reward model's file
    assert (trained / "ppo_curves.png").stat().st_size > 0
    log = job_log(trained)
    assert "64 prompts per rollout batch, 1 completion each, 2 optimizer step(s)" in log
    assert "critic from" in log


def test_a_resumed_run_continues_the_same_run(
    sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """Two epochs over each rollout batch with an adaptive KL coefficient: 3 steps, then the
    same command with max_steps 6 resumes mid-batch (rollouts.pt), its critic and KL
    coefficient from the checkpoint, and logs what the uninterrupted run logs."""
    scorer = reward_model(tiny_reward_model)
    common = (
        *CONSTANT_LR,
        *NO_VALIDATION,
        f"{STAGE}.model.rlhf.ppo.epochs=2",
        f"{STAGE}.model.rlhf.ppo.num_rollout_samples=32",
        f"{STAGE}.model.rlhf.ppo.kl_target=0.01",
        f"{STAGE}.model.rlhf.ppo.kl_horizon=100",
        f"{STAGE}.trainer.log_every_n_steps=1",
    )
    whole = run_stage(
        tmp_path / "whole", sft_start, scorer, *common, f"{STAGE}.trainer.max_steps=6"
    )
    run_stage(tmp_path / "parts", sft_start, scorer, *common, f"{STAGE}.trainer.max_steps=3")
    parts = run_stage(
        tmp_path / "parts", sft_start, scorer, *common, f"{STAGE}.trainer.max_steps=6"
    )
    assert "resumed from" in job_log(parts) and (parts / "rollouts.pt").is_file()
    for name in ("reward", "kl", "kl_coef", "value_loss", "entropy", "reduced_train_loss"):
        mine, reference = metric(parts, name), metric(whole, name)
        assert set(range(4, 7)) <= set(mine), (name, mine)
        for step in range(4, 7):
            if step in reference:
                assert mine[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-9), (
                    name,
                    step,
                )
    coefficients = metric(whole, "kl_coef")
    assert coefficients[1] == pytest.approx(0.02) and coefficients[3] != coefficients[1]


@pytest.fixture(scope="module")
def short_run(
    sft_start: Path, tiny_reward_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    results = tmp_path_factory.mktemp("ppo_short")
    return run_stage(results, sft_start, reward_model(tiny_reward_model), *SHORT)


@pytest.mark.parametrize(
    "layout",
    ["tensor_model_parallel_size=2", "pipeline_model_parallel_size=2"],
    ids=["tp2", "pp2"],
)
def test_a_model_parallel_actor_and_critic_train_as_one_process(
    layout: str, short_run: Path, sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """The same rollouts and the same actor and critic losses."""
    two = run_stage(
        tmp_path,
        sft_start,
        reward_model(tiny_reward_model),
        *SHORT,
        f"{STAGE}.trainer.devices=2",
        f"{STAGE}.model.{layout}",
    )
    assert metric(two, "completion_length") == metric(short_run, "completion_length")
    for name in ("reward", "kl", "value_loss", "entropy", "reduced_train_loss"):
        mine, reference = metric(two, name), metric(short_run, name)
        assert sorted(mine) == sorted(reference), name
        for step, value in mine.items():
            assert value == pytest.approx(reference[step], rel=1e-4, abs=1e-5), (name, step)


def test_two_data_parallel_replicas_on_the_reference_s_prompt_files(
    sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """The reference's PPO prompt files hold {"text": prompt} (5.16.2.4); each replica samples
    its share of a batch and both train on all of it."""
    prompts = tmp_path / "prompts.jsonl"
    lines = TRAIN.read_text().splitlines()
    prompts.write_text(
        "".join(json.dumps({"text": json.loads(line)["prompt"]}) + "\n" for line in lines)
    )
    two = run_stage(
        tmp_path / "results",
        sft_start,
        reward_model(tiny_reward_model),
        *SHORT,
        f"{STAGE}.trainer.devices=2",
        f"{STAGE}.model.data.data_prefix.train=[{prompts}]",
    )
    assert sorted(metric(two, "value_loss")) == [1, 2, 3, 4]
    log = job_log(two)
    assert f"prompts: {len(lines)} train" in log and "rank 1: rlhf_ppo (every weight)" in log


def test_lora_ppo_writes_the_peft_file_and_its_initial_policy_is_the_base(
    sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """LoRA's adapters start at zero, so the initial policy (the adapters at their start) is
    the base: the KL is 0 on the first batch."""
    tuned = run_stage(
        tmp_path,
        sft_start,
        reward_model(tiny_reward_model),
        *SHORT,
        f"{STAGE}.model.peft.peft_scheme=lora",
    )
    kl = metric(tuned, "kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-9) and kl[3] != 0, kl
    output = tuned / "checkpoints" / "megatron_gpt_ppo_actor.nemo"
    assert peft_file.is_peft_file(output)
    assert peft_file.read(output).settings.scheme == "lora"


def test_the_servers_layout_trains_as_the_colocated_one(
    short_run: Path, sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """The reward model, the initial policy and the critic as jobs of their own (here local
    processes beside the actor's): the same rollouts and the same critic as in one job, the
    critic's checkpoint in its own folder, and every server ended with the run."""
    served = run_stage(tmp_path, sft_start, reward_model(tiny_reward_model), *SHORT, *SERVED)
    for name in ("reward", "completion_length", "value_loss", "values"):
        mine, reference = metric(served, name), metric(short_run, name)
        for step in (1, 2):  # the first rollout batch: the same weights everywhere
            assert mine[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), name
    assert metric(served, "kl")[1] == pytest.approx(0.0, abs=1e-5)
    assert (served / "critic" / "checkpoints" / "critic--step=4").is_dir()
    companions = served.parent / "companions"
    for role in ROLES:
        assert f"serving {role} at" in (companions / f"{role}.log").read_text()
        address = json.loads((served / "servers" / f"{role}.json").read_text())
        assert not Path(f"/proc/{address['pid']}").exists(), role


def test_a_server_that_dies_ends_the_run_in_one_line(
    sft_start: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    """The critic's server killed while the actor trains: the run stops with one line naming
    it (not a hang), and the other servers end with it."""
    command = overrides(
        tmp_path, sft_start, reward_model(tiny_reward_model), *SHORT, *SERVED,
        f"{STAGE}.trainer.max_steps=400",
    )  # fmt: skip
    results = tmp_path / "gpt3_tiny" / STAGE / "results"
    with subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ) as launcher:
        critic = results / "servers" / "critic.json"
        deadline = time.monotonic() + 300
        while not (critic.is_file() and metric_lines(results)) and launcher.poll() is None:
            assert time.monotonic() < deadline, "the run never started training"
            time.sleep(0.5)
        os.kill(json.loads(critic.read_text())["pid"], signal.SIGKILL)
        output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode != 0, output[-2000:]
    log = job_log(results)
    errors = [line for line in log.splitlines() if line.startswith("error: the job's critic")]
    assert len(errors) == 1 and "exit code 137" in errors[0], log[-3000:]
    for role in ("reward_model", "initial_policy"):
        address = json.loads((results / "servers" / f"{role}.json").read_text())
        assert not Path(f"/proc/{address['pid']}").exists(), role


@pytest.mark.parametrize("backend", ["bcp", "k8s"])
def test_the_servers_layout_is_refused_where_no_companion_starts(
    backend: str, tiny_portable: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    scorer = reward_model(tiny_reward_model)
    result = run_main(
        *overrides(tmp_path, tiny_portable, scorer, *SERVED),
        f"cluster_type={backend}",
        "container=nvcr.io/nvidia/nemo:24.05",
        "cluster.volumes=[{name: work, mount_path: /, host_path: /}]"
        if backend == "k8s"
        else "dry_run=true",
        "dry_run=true",
    )
    one_error_line(result, f"{STAGE}.model.rlhf.layout", f"cluster_type={backend}", "colocated")


def bad(override: str, fragments: list[str]) -> Any:
    return pytest.param(override, fragments, id=override.rsplit(".", 1)[-1].split("=")[0])


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        bad(f"{STAGE}.model.rlhf.ppo.kl_target=0", ["kl_target: 0.0", "above 0"]),
        bad(f"{STAGE}.model.rlhf.ppo.kl_target=-1", ["kl_target: -1.0", "or null"]),
        bad(
            f"{STAGE}.model.rlhf.ppo.num_rollout_samples=48",
            ["num_rollout_samples: 48", "multiple of", "global_batch_size=32"],
        ),
        bad(f"{STAGE}.model.rlhf.ppo.gae_lambda=1.5", ["gae_lambda 1.5", "[0, 1]"]),
        bad(f"{STAGE}.model.rlhf.ppo.ratio_eps=0", ["ratio_eps: 0.0", "(0, 1)"]),
        bad(f"{STAGE}.model.rlhf.ppo.temperature=0", ["temperature: 0.0", "above 0"]),
        bad(f"+{STAGE}.model.rlhf.ppo.clip=0.2", ["rlhf.ppo.clip", "no program reads it"]),
        bad(f"{STAGE}.model.rlhf.critic.optim.lr=0", ["critic.optim.lr: 0", "above 0"]),
    ],
)
def test_bad_settings_are_one_line_before_anything_runs(
    override: str, fragments: list[str], tiny_portable: Path, tmp_path: Path
) -> None:
    result = run_main(*overrides(tmp_path, tiny_portable, tiny_portable, override))
    one_error_line(result, *fragments)
    assert not (tmp_path / "gpt3_tiny").exists()


def test_the_reward_model_and_critic_must_be_reward_models_of_the_policy_s_tokenizer(
    tiny_portable: Path, tiny_reward_model: Path, t5_converted: Path, tmp_path: Path
) -> None:
    t5 = t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"
    scorer = reward_model(tiny_reward_model)
    reward_key = f"{STAGE}.model.rlhf.reward_model.restore_from_path"
    critic_key = f"{STAGE}.model.rlhf.critic.restore_from_path"
    cases = [
        (t5, (), reward_key, "hold different tokenizers"),
        (tiny_portable, (), reward_key, "not a reward model"),
        (scorer, (f"{critic_key}={tiny_portable}",), critic_key, "not a reward model"),
    ]
    for model, extra, key, fragment in cases:
        result = run_main(*overrides(tmp_path, tiny_portable, model, *extra))
        one_error_line(result, key, fragment)
    assert not (tmp_path / "gpt3_tiny").exists()


def test_gae_by_hand() -> None:
    """Three tokens, gamma 0.9, lambda 0.8: deltas and their discounted sums from the end."""
    rewards = torch.tensor([0.0, -0.1, 1.0], dtype=torch.float64)
    values = torch.tensor([0.5, 0.4, 0.7], dtype=torch.float64)
    advantages, returns = gae(rewards, values, 0.9, 0.8)
    deltas = [0.0 + 0.9 * 0.4 - 0.5, -0.1 + 0.9 * 0.7 - 0.4, 1.0 - 0.7]
    expected = [0.0, 0.0, deltas[2]]
    expected[1] = deltas[1] + 0.72 * expected[2]
    expected[0] = deltas[0] + 0.72 * expected[1]
    assert advantages.tolist() == pytest.approx(expected)
    summed = [a + v for a, v in zip(expected, values.tolist(), strict=True)]
    assert returns.tolist() == pytest.approx(summed)


def test_the_adaptive_kl_coefficient_follows_the_target() -> None:
    # The KL's relative error times the batch's share of the horizon, the error within +-20%.
    assert adapted_coefficient(0.1, 0.2, 0.1, 1000, 100) == pytest.approx(0.1 * 1.02)
    assert adapted_coefficient(0.1, 0.05, 0.1, 1000, 100) == pytest.approx(0.1 * 0.98)
    assert adapted_coefficient(0.1, 0.09, 0.1, 1000, 100) == pytest.approx(0.1 * 0.99)
    assert adapted_coefficient(0.1, 0.1, 0.1, 1000, 100) == pytest.approx(0.1)
    assert not math.isnan(adapted_coefficient(0.1, 0.0, 0.1, 1000, 100))
