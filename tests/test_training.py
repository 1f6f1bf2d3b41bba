"""The pretraining job on megatron-core, for real on the CPU (gloo): learning, TP/PP/DP
equivalence, signal-stop and exact resume, torn checkpoints, and the artifacts a run leaves."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.formats.progress import EXIT_PREEMPTED, complete_checkpoints
from tests.support import REPO
from tests.support.commands import ONE_THREAD, run_main
from tests.support.training import (
    assert_same_losses,
    losses,
    pretrain_command,
    stop_with_signal,
    train,
    write_small_gpt_config,
)

LAYOUT_STEPS = ("training.trainer.max_steps=6",)


@pytest.fixture(scope="module")
def layouts(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run each parallel layout is compared with (single/), trained once,
    and the dataset index cache (i/) all of them read: see
    test_interleaved_pipeline_matches_the_plain_pipeline."""
    folder = tmp_path_factory.mktemp("layouts")
    index = f"training.model.data.index_mapping_dir={folder}/i"
    train(write_small_gpt_config(prepared, folder / "single", *LAYOUT_STEPS, index))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("training.model.tensor_model_parallel_size=2",),
        ("training.model.pipeline_model_parallel_size=2",),
        ("training.model.tensor_model_parallel_size=2", "training.model.sequence_parallel=true"),
    ],
    ids=["tp2", "pp2", "tp2-sequence-parallel"],
)
def test_parallel_layouts_match_a_single_process(
    prepared: Path, layouts: Path, tmp_path: Path, layout: tuple[str, ...]
) -> None:
    # One index cache for both runs: see test_interleaved_pipeline_matches_the_plain_pipeline.
    steps = (*LAYOUT_STEPS, f"training.model.data.index_mapping_dir={layouts}/i")
    parallel = write_small_gpt_config(
        prepared, tmp_path / "parallel", *steps, "training.trainer.devices=2", *layout
    )
    train(parallel, processes=2)
    assert_same_losses(layouts / "single", tmp_path / "parallel", 1e-4)


@pytest.mark.slow
def test_interleaved_pipeline_matches_the_plain_pipeline(prepared: Path, tmp_path: Path) -> None:
    """PP=2 with two virtual chunks per stage against PP=2 without, both on two processes.

    Its step-1 losses (before any update) used to differ now and then by up to 6e-4: the
    initialisation skipped half of a swiglu fc1 weight when a dead view's id was reused
    (tests/test_init_weights.py). Both runs read one dataset index cache.
    """
    improved = (
        "training.trainer.max_steps=4",
        "training.model.num_layers=4",
        "training.model.position_embedding_type=rope",
        "training.model.activation=swiglu",
        "training.model.normalization=layernorm1p",
        "training.model.bias=false",
        "training.model.share_embeddings_and_output_weights=false",
        "training.trainer.devices=2",
        "training.model.pipeline_model_parallel_size=2",
        f"training.model.data.index_mapping_dir={tmp_path / 'index'}",
    )
    train(write_small_gpt_config(prepared, tmp_path / "plain", *improved), processes=2)
    interleaved = ("training.model.virtual_pipeline_model_parallel_size=2",)
    train(write_small_gpt_config(prepared, tmp_path / "vp", *improved, *interleaved), processes=2)
    assert_same_losses(tmp_path / "plain", tmp_path / "vp", 1e-4)


def plain_tensors(checkpoint: Path) -> dict[str, Any]:
    """Every tensor of a megatron-core (torch_dist) checkpoint, whole, by its key: read in this
    process with torch.distributed.checkpoint, which needs no process group (megatron-core's
    load_plain_tensors does, and a process of its own to start one costs seconds)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint))
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def weight_differences(first: Path, second: Path) -> dict[str, float]:
    """For each model tensor of the two runs' newest checkpoints, |a - b| / |a| (Frobenius)."""
    a, b = (
        plain_tensors(complete_checkpoints(run / "checkpoints")[-1].path) for run in (first, second)
    )
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return {
        k: ((v.double() - b[k].double()).norm() / v.double().norm().clamp_min(1e-12)).item()
        for k, v in a.items()
        if not k.startswith("optimizer")
    }


# Long enough that the signal, sent once 3 steps are logged, stops the run well before its end;
# a periodic checkpoint in the middle of the resumed part too.
STOP_AND_RESUME_STEPS = (
    "training.trainer.max_steps=20",
    "training.exp_manager.checkpoint_callback_params.every_n_train_steps=10",
)


@pytest.fixture(scope="module")
def uninterrupted(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 20 steps trained without a stop: the log folder both resume cases compare with."""
    reference = tmp_path_factory.mktemp("uninterrupted") / "reference"
    train(write_small_gpt_config(prepared, reference, *STOP_AND_RESUME_STEPS))
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("first_processes", [1, 2], ids=["same-layout", "dp2-then-dp1"])
def test_signal_stop_and_resume_match_an_uninterrupted_run(
    prepared: Path, uninterrupted: Path, tmp_path: Path, first_processes: int
) -> None:
    steps = STOP_AND_RESUME_STEPS

    first = write_small_gpt_config(
        prepared, tmp_path / "resumed", *steps, f"training.trainer.devices={first_processes}"
    )
    assert stop_with_signal(first, tmp_path / "resumed", first_processes) in (
        EXIT_PREEMPTED,
        # torchrun reports its workers' stop as its own failure; the checkpoint is what counts
        *(() if first_processes == 1 else (1, -signal.SIGTERM)),
    )
    stopped_at = max(losses(tmp_path / "resumed"))
    assert stopped_at < 20
    # The same command again resumes, here with one process (a different data-parallel size
    # when the first part ran on two).
    second = write_small_gpt_config(prepared, tmp_path / "resumed", *steps)
    result = train(second)
    assert "resumed from" in result.stdout

    tolerance = 0.0 if first_processes == 1 else 1e-4
    assert_same_losses(uninterrupted, tmp_path / "resumed", tolerance)
    differences = weight_differences(uninterrupted, tmp_path / "resumed")
    if tolerance:
        # The key third of the QKV bias has a zero gradient in exact arithmetic (softmax ignores a
        # shift shared by all keys), so Adam turns rounding noise there into full-size steps: it
        # differs between reduction orders by design and says nothing about the resume.
        differences = {k: v for k, v in differences.items() if not k.endswith("linear_qkv.bias")}
    worst = sorted(differences.items(), key=lambda item: item[1])[-3:]
    assert differences and worst[-1][1] <= tolerance, worst


# A checkpoint every 2 steps, each kept.
EVERY_TWO = (
    "training.exp_manager.checkpoint_callback_params.every_n_train_steps=2",
    "training.exp_manager.checkpoint_callback_params.save_top_k=-1",
)


@pytest.fixture(scope="module")
def checkpointed(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps with checkpoints at steps 2 and 4, trained once: the log folder the resume tests
    below each copy, then tear or damage."""
    log_dir = tmp_path_factory.mktemp("checkpointed") / "run"
    train(write_small_gpt_config(prepared, log_dir, "training.trainer.max_steps=4", *EVERY_TWO))
    return log_dir


def copy_of(run: Path, tmp_path: Path) -> Path:
    log_dir = tmp_path / "run"
    shutil.copytree(run, log_dir)
    return log_dir


NAME_TEMPLATE = "megatron_gpt--{val_loss:.2f}-{step}-{consumed_samples}"


@pytest.mark.parametrize(
    ("template", "values", "name"),
    [
        (
            NAME_TEMPLATE,
            {"step": 8, "consumed_samples": 32.0},
            "megatron_gpt--step=8-consumed_samples=32.0",
        ),
        (
            NAME_TEMPLATE,
            {"step": 8, "consumed_samples": 32.0, "val_loss": 1.234},
            "megatron_gpt--val_loss=1.23-step=8-consumed_samples=32.0",
        ),
        ("megatron_gpt--{step}-{val_loss:.2f}", {"step": 8}, "megatron_gpt--step=8"),
        ("{val_loss:.2f}-{step}", {"step": 8, "val_loss": float("nan")}, "step=8"),
    ],
)
def test_a_metric_without_a_value_is_left_out_of_the_checkpoint_name(
    template: str, values: dict[str, float], name: str
) -> None:
    """A checkpoint saved before the first validation was named `val_loss=nan`."""
    from launcher_scripts.jobs.training.checkpointing import checkpoint_name

    assert checkpoint_name(template, values) == name


@pytest.mark.slow
def test_torn_checkpoints_are_ignored_on_resume(
    prepared: Path, checkpointed: Path, tmp_path: Path
) -> None:
    log_dir = copy_of(checkpointed, tmp_path)
    checkpoints = log_dir / "checkpoints"
    # A save that crashed before its rename, and a folder that lost its state file.
    (checkpoints / ".tmp-megatron_gpt--step=8").mkdir()
    torn = checkpoints / "megatron_gpt--val_loss=1.00-step=8-consumed_samples=32.0"
    torn.mkdir()
    (torn / "common.pt").write_bytes(b"partial")
    result = train(
        write_small_gpt_config(prepared, log_dir, "training.trainer.max_steps=6", *EVERY_TWO)
    )
    assert "resumed from" in result.stdout and "step=4-" in result.stdout
    assert not (checkpoints / ".tmp-megatron_gpt--step=8").exists()
    assert min(s for s in losses(log_dir) if s > 4) == 5


@pytest.mark.slow
def test_a_damaged_checkpoint_is_passed_over_on_resume_saying_so(
    prepared: Path, checkpointed: Path, tmp_path: Path
) -> None:
    """A shard cut short after the save (a copy, a sync): resume takes the previous complete
    checkpoint, says so, and continues exactly from there."""
    log_dir = copy_of(checkpointed, tmp_path)
    first = losses(log_dir)
    checkpoints = log_dir / "checkpoints"
    [step2] = checkpoints.glob("*-step=2-*")
    [step4] = checkpoints.glob("*-step=4-*")
    shard = sorted(step4.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])

    result = train(
        write_small_gpt_config(prepared, log_dir, "training.trainer.max_steps=6", *EVERY_TWO)
    )

    assert f"checkpoint {step4} is damaged (its file {shard.name} has 1000 bytes" in result.stdout
    assert f"resuming from the previous complete checkpoint {step2}" in result.stdout
    assert f"resumed from {step2} at step 2" in result.stdout
    second = losses(log_dir)
    assert sorted(second) == [1, 2, 3, 4, 5, 6]
    assert [second[step] for step in (3, 4)] == [first[step] for step in (3, 4)]


@pytest.mark.slow
def test_a_damaged_only_checkpoint_stops_resume_in_one_line(
    prepared: Path, checkpointed: Path, tmp_path: Path
) -> None:
    log_dir = copy_of(checkpointed, tmp_path)
    [newest] = (log_dir / "checkpoints").glob("*-step=4-*")
    shutil.rmtree(newest)
    [checkpoint] = (log_dir / "checkpoints").iterdir()  # step 2's
    (checkpoint / "common.pt").unlink()
    metrics = (log_dir / "metrics.jsonl").read_bytes()
    config = write_small_gpt_config(prepared, log_dir, "training.trainer.max_steps=6", *EVERY_TWO)

    result = subprocess.run(
        pretrain_command(config, 1), capture_output=True, text=True, cwd=REPO, timeout=300
    )

    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {checkpoint} is damaged (its file common.pt is")
    assert "restore its files from a copy, or delete it to start training from scratch" in last
    # Nothing trained over it (a training from scratch would log its steps again).
    assert (log_dir / "metrics.jsonl").read_bytes() == metrics and max(losses(log_dir)) == 4


@pytest.mark.slow
def test_an_empty_split_is_one_clear_error(prepared: Path, tmp_path: Path) -> None:
    config = write_small_gpt_config(
        prepared, tmp_path / "run", 'training.model.data.splits_string="99990,8,2"'
    )
    result = subprocess.run(
        pretrain_command(config, 1), capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: training.model.data.splits_string='99990,8,2' leaves the validation split"
        )
    )


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (
            ["training.model.global_batch_size=12", "training.trainer.devices=2"],
            "training.model.global_batch_size",
            "Use a multiple of 8",
        ),
        (
            ["training.model.tensor_model_parallel_size=3", "training.trainer.devices=3"],
            "training.model.num_attention_heads",
            "divides the number of heads",
        ),
        (
            ["training.model.pipeline_model_parallel_size=3", "training.trainer.devices=3"],
            "training.model.num_layers",
            "divisible by PP x VP",
        ),
        (
            ["training.model.tensor_model_parallel_size=2"],
            "training.model.tensor_model_parallel_size",
            "trainer.devices",
        ),
        (
            ["training.model.encoder_seq_length=256"],
            "training.model.data.seq_length",
            "max_position_embeddings",
        ),
        (["training.model.activation=relu"], "training.model.activation", "swiglu"),
        (
            ["training.model.data.data_prefix=[0.5,/nope/a,0.5]"],
            "training.model.data.data_prefix",
            "weight, path",
        ),
        (
            ["training.run.rendezvous_timeout_seconds=0"],
            "training.run.rendezvous_timeout_seconds",
            "instead of hanging",
        ),
    ],
)
def test_training_preflight_names_the_key(
    tmp_path: Path, overrides: list[str], key: str, fix: str
) -> None:
    result = run_main(
        f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", *overrides
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), result.stderr
    assert fix in lines[0]
    assert not (tmp_path / "results").exists()


def test_training_needs_its_data_unless_an_earlier_stage_writes_it(tmp_path: Path) -> None:
    paths = (f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data")
    alone = run_main(*paths, "stages=[training]")
    assert alone.returncode == 2 and "data_prefix" in alone.stderr
    assert "Run the data_preparation recipe that writes it first" in alone.stderr
    assert not (tmp_path / "results").exists()
    # A dry run plans the run anyway and lists what is not there yet.
    planned = run_main(*paths, "stages=[training]", "dry_run=true")
    assert planned.returncode == 0, planned.stderr
    assert "not there yet" in planned.stdout
    prefix = tmp_path / "data" / "custom_dataset" / "preprocessed" / "tiny_corpus_text_document"
    assert str(prefix) in planned.stdout
    both = run_main(*paths, "dry_run=true")
    assert both.returncode == 0, both.stderr
    assert "not there yet" not in both.stdout


def small_tokenizer(folder: Path, vocab_size: int = 64) -> Path:
    """A SentencePiece model far smaller than the prepared data's (8000 pieces)."""
    import sentencepiece

    texts = [f"a small tokenizer for a test number {n}" for n in range(50)]
    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(folder / "small"), vocab_size=vocab_size,
        hard_vocab_limit=False, bos_id=-1, eos_id=1, unk_id=2, pad_id=0, minloglevel=2,
    )  # fmt: skip
    model = folder / "small.model"
    assert sentencepiece.SentencePieceProcessor(model_file=str(model)).get_piece_size() < 100
    return model


@pytest.mark.parametrize("statistics", ["recorded", "missing"])
def test_a_tokenizer_smaller_than_the_data_is_refused_in_preflight(
    prepared: Path, tmp_path: Path, statistics: str
) -> None:
    """The record data preparation wrote beside the shard names the tokenizer it was made
    with; for data prepared elsewhere, the largest token id comes from the .bin itself."""
    shutil.copytree(prepared / "data", tmp_path / "data")
    prefix = tmp_path / "data" / "custom_dataset" / "preprocessed" / "tiny_corpus_text_document"
    if statistics == "missing":
        Path(f"{prefix}.meta.json").unlink()
    paths = (f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data")
    small = small_tokenizer(tmp_path / "tok")

    refused = run_main(*paths, "stages=[training]", f"training.model.tokenizer.model={small}")

    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    if statistics == "recorded":
        start = f"error: training.model.tokenizer.model: the recipe's tokenizer (model {small} "
        assert lines[0].startswith(start), lines[0]
        assert f"data_prefix {prefix} was tokenized with (model " in lines[0]
    else:
        assert lines[0].startswith(f"error: training.model.tokenizer.model: {small} has "), lines[0]
        assert f"training.model.data.data_prefix {prefix} holds token id" in lines[0]
    assert not (tmp_path / "results").exists()
    # The tokenizer the data was made with passes.
    planned = run_main(*paths, "stages=[training]", "dry_run=true")
    assert planned.returncode == 0, planned.stderr


@pytest.mark.slow
def test_a_tokenizer_smaller_than_the_data_stops_the_job_at_its_start(
    prepared: Path, tmp_path: Path
) -> None:
    """Where the preflight could not look (data written by an earlier stage of the same run),
    the job checks before its first step: one line, not megatron-core's IndexError."""
    small = small_tokenizer(tmp_path / "tok")
    config = write_small_gpt_config(
        prepared, tmp_path / "run", f"training.model.tokenizer.model={small}"
    )
    result = subprocess.run(
        pretrain_command(config, 1), capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "IndexError" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: training.model.tokenizer.model: {small} has "), last
    assert "holds token id" in last
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_token_ids_without_statistics_are_bounded_by_the_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .bin too large to scan, with no record: a uint16 dataset cannot hold an id a
    70000-token vocabulary lacks; below that bound the check cannot tell and lets it be."""
    import numpy as np

    from launcher_scripts.errors import ConfigError
    from launcher_scripts.formats import indexed_writer
    from launcher_scripts.recipes import vocabulary

    prefix = tmp_path / "data_text_document"
    indexed_writer.write_dataset(prefix, [[5, 300, 9]], np.uint16)
    args = ("tok.model", "training.model.tokenizer.model", "training")
    with pytest.raises(ConfigError, match="holds token id 300"):
        vocabulary.check_token_ids([str(prefix)], 300, *args)  # recorded
    Path(f"{prefix}.meta.json").unlink()
    with pytest.raises(ConfigError, match="holds token id 300"):
        vocabulary.check_token_ids([str(prefix)], 300, *args)  # scanned
    vocabulary.check_token_ids([str(prefix)], 301, *args)
    monkeypatch.setattr(vocabulary, "SCAN_LIMIT_BYTES", 0)
    assert vocabulary.largest_token_id(prefix) == vocabulary.LargestId(
        65535, False, "its dtype uint16"
    )
    vocabulary.check_token_ids([str(prefix)], 70000, *args)
    vocabulary.check_token_ids([str(prefix)], 300, *args)  # unknown: not refused


TWO_DEVICES = ("training.trainer.devices=2", "training.model.tensor_model_parallel_size=2")


@pytest.mark.slow
def test_fewer_processes_than_the_recipe_asks_for_is_one_line(
    prepared: Path, tmp_path: Path
) -> None:
    """The job started by hand with one process where the recipe has two devices."""
    config = write_small_gpt_config(prepared, tmp_path / "run", *TWO_DEVICES)
    result = subprocess.run(
        pretrain_command(config, 1),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=ONE_THREAD,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: trainer.num_nodes x trainer.devices: the recipe asks for 2 processes but 1 were "
        "started"
    ), last


@pytest.mark.slow
def test_a_missing_process_fails_the_rendezvous_instead_of_hanging(
    prepared: Path, tmp_path: Path
) -> None:
    """Rank 0 of two started by srun (no torchrun) while rank 1 never comes: one clear line."""
    config = write_small_gpt_config(
        prepared, tmp_path / "run", *TWO_DEVICES, "training.run.rendezvous_timeout_seconds=3"
    )
    env = {k: v for k, v in ONE_THREAD.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env.update(
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result = subprocess.run(
        pretrain_command(config, 1), capture_output=True, text=True, cwd=REPO, timeout=300, env=env
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "rank 0/2 local_rank 0" in result.stdout and "launcher slurm" in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 0: not all 2 processes joined at 127.0.0.1:"), last
    assert "within 3 s" in last and "run.rendezvous_timeout_seconds" in last
