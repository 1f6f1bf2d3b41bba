"""Bad input: one clear line, a non-zero exit, nothing written, nothing run."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from tests.support.commands import assert_one_line_error, run_main


@pytest.fixture
def results(tmp_path: Path) -> Path:
    return tmp_path / "results"


def launch(results: Path, *overrides: str):
    return run_main(
        f"base_results_dir={results}", f"data_dir={results.parent / 'data'}", *overrides
    )


def test_unknown_stage(results: Path) -> None:
    assert_one_line_error(launch(results, "stages=[data_prep]"), "stages", "data_preparation")
    assert not results.exists()


def test_tuning_stage_without_its_base_model(results: Path) -> None:
    result = launch(results, "stages=[data_preparation,ia3_learning]")
    assert_one_line_error(result, "ia3_learning.model.language_model_path", "does not exist")
    assert not results.exists()


def test_unknown_recipe_lists_available(results: Path) -> None:
    result = launch(results, "data_preparation=gpt3/pile")
    assert_one_line_error(result, "gpt3/pile", "generic/custom_dataset", "gpt3/download_gpt3_pile")


def test_missing_value(results: Path) -> None:
    result = launch(results, "data_preparation.train_tokenizer_args.model_prefix=???")
    assert_one_line_error(result, "data_preparation.train_tokenizer_args.model_prefix", "???")
    assert not results.exists()


def test_missing_input_path(results: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = launch(results, f"data_preparation.raw_dataset_files=[{missing}]")
    assert_one_line_error(result, "data_preparation.raw_dataset_files[0]", str(missing))
    assert not results.exists()


def test_training_data_the_runs_data_preparation_does_not_write(results: Path) -> None:
    """The default data preparation with a recipe trained on the Pile: the error names what
    the run does write and the family's own data recipe."""
    result = launch(results, "stages=[data_preparation,training]", "training=gpt3/5b")
    assert_one_line_error(
        result,
        "training.model.data.data_prefix",
        "my-gpt3_00_text_document.bin does not exist and no earlier stage of this run writes it",
        "(this run's data preparation writes ",
        "tiny_corpus_text_document)",
        "data_preparation=gpt3/download_gpt3_pile",
    )
    assert not results.exists()


def test_a_base_model_the_run_writes_under_another_name_is_shown(results: Path) -> None:
    """fine_tuning=gpt3/squad tunes gpt3_126m's file; this run converts gpt3_tiny's."""
    stages = "stages=[data_preparation,training,conversion,fine_tuning]"
    result = launch(results, stages, "fine_tuning=gpt3/squad")
    written = results / "gpt3_tiny" / "convert_nemo" / "megatron_gpt.nemo"
    assert_one_line_error(
        result,
        "fine_tuning.model.restore_from_path: ",
        "gpt3_126m/convert_nemo/megatron_gpt.nemo does not exist and no earlier stage of this "
        f"run writes it (this run writes {written})",
    )
    assert not results.exists()


def test_several_nodes_are_refused_by_the_local_backend(results: Path) -> None:
    """The local backend starts one machine's processes: a job of two nodes would start half of
    them and wait for the rest."""
    result = launch(results, "stages=[data_preparation,training]", "training.trainer.num_nodes=2")
    assert_one_line_error(
        result,
        "training.trainer.num_nodes: job gpt3_tiny asks for 2 nodes but cluster_type=local",
        "Set training.trainer.num_nodes=1",
        "cluster_type=bcm",
    )
    assert not results.exists()


# Each stage that takes a node count, asking for several nodes (tuning stages: of one device).
SEVERAL_NODES = {
    "training": ("stages=[training]", "training.trainer.num_nodes=2"),
    "published training recipe": ("stages=[training]", "training=gpt3/5b"),
    **{
        stage: (f"stages=[{stage}]", f"{stage}.trainer.num_nodes=2", f"{stage}.trainer.devices=1")
        for stage in ("fine_tuning", "peft", "prompt_learning", "adapter_learning", "ia3_learning")
    },
}


@pytest.mark.parametrize("overrides", SEVERAL_NODES.values(), ids=SEVERAL_NODES.keys())
def test_a_dry_run_refuses_several_nodes_on_the_local_backend_as_the_run_does(
    results: Path, overrides: tuple[str, ...]
) -> None:
    result = launch(results, *overrides, "dry_run=true")
    stage = overrides[0].removeprefix("stages=[").removesuffix("]")
    assert_one_line_error(
        result,
        f"error: {stage}.trainer.num_nodes: job ",
        " nodes but cluster_type=local runs on this machine",
        f"Set {stage}.trainer.num_nodes=1",
    )
    assert not results.exists()


CONTEXT_PARALLEL = ("stages=[training]", "training.model.context_parallel_size=2")


def test_context_parallelism_on_cpu_is_refused_before_the_job(results: Path) -> None:
    result = launch(results, *CONTEXT_PARALLEL, "training.trainer.devices=2", "dry_run=true")
    assert_one_line_error(
        result,
        "error: training.model.context_parallel_size: is 2 but this run is on CPU "
        "(training.trainer.accelerator=cpu) and context parallelism needs Transformer Engine",
        "Set training.model.context_parallel_size=1",
    )
    assert not results.exists()


def test_context_parallelism_asking_for_gpus_this_machine_lacks_is_refused(
    results: Path,
) -> None:
    """A recipe asking for GPUs on the local backend runs on the CPU of a machine without one:
    preflight asks the launcher's Python, which runs the jobs, whether torch finds a GPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the jobs would run on it")
    result = launch(
        results,
        *CONTEXT_PARALLEL,
        "training.trainer.devices=2",
        "training.trainer.accelerator=gpu",
        "training.model.transformer_engine=true",
        "dry_run=true",
    )
    assert_one_line_error(
        result,
        "error: training.model.context_parallel_size: is 2 but the jobs run on this machine, "
        "where torch finds no GPU",
        "Set training.model.context_parallel_size=1",
    )


def test_context_parallelism_without_transformer_engine_is_refused(results: Path) -> None:
    result = launch(
        results,
        *CONTEXT_PARALLEL,
        "training.trainer.devices=2",
        "training.trainer.accelerator=gpu",
        "cluster_type=bcm",
        "dry_run=true",
    )
    assert_one_line_error(
        result,
        "error: training.model.context_parallel_size: is 2 but "
        "training.model.transformer_engine is not true",
        "Set training.model.transformer_engine=true",
    )


def test_empty_input_file(results: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl.gz"
    empty.write_bytes(b"")
    result = launch(results, f"data_preparation.raw_dataset_files=[{empty}]")
    assert_one_line_error(result, "raw_dataset_files[0]", "is empty")


def test_unsupported_input_suffix(results: Path, tmp_path: Path) -> None:
    parquet = tmp_path / "a.parquet"
    parquet.write_bytes(b"x")
    assert_one_line_error(
        launch(results, f"data_preparation.raw_dataset_files=[{parquet}]"), "a.parquet", ".jsonl"
    )


def test_two_inputs_writing_one_shard(results: Path, tmp_path: Path) -> None:
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        with gzip.open(tmp_path / folder / "a.jsonl.gz", "wt") as out:
            out.write('{"text": "hello"}\n')
    files = f"[{tmp_path / 'x' / 'a.jsonl.gz'},{tmp_path / 'y' / 'a.jsonl.gz'}]"
    result = launch(results, f"data_preparation.raw_dataset_files={files}")
    assert_one_line_error(result, "raw_dataset_files[1]", "Rename")


def test_missing_tokenizer(results: Path) -> None:
    result = launch(
        results,
        "data_preparation.train_tokenizer=false",
        "data_preparation.tokenizer_model=/no/such/tokenizer.json",
    )
    assert_one_line_error(result, "data_preparation.tokenizer_model", "/no/such/tokenizer.json")


def test_bad_file_numbers(results: Path) -> None:
    result = launch(
        results, "data_preparation=gpt3/download_gpt3_pile", "data_preparation.file_numbers=3-x"
    )
    assert_one_line_error(result, "data_preparation.file_numbers", "3-x")


def test_bad_choice(results: Path) -> None:
    assert_one_line_error(launch(results, "cluster_type=slurm"), "cluster_type", "bcm")
    result = launch(results, "numa_mapping.mode=everything")
    assert_one_line_error(result, "numa_mapping.mode", "unique_contiguous")


def test_unknown_key(results: Path) -> None:
    assert_one_line_error(launch(results, "data_preparation.workers=3"), "data_preparation.workers")


def test_full_error_shows_the_traceback(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    from launcher_scripts.main import main

    with pytest.raises(Exception, match="stages"):
        main([f"base_results_dir={results}", "stages=[nope]"])


def test_pile_dry_run_downloads_nothing(results: Path, tmp_path: Path) -> None:
    result = launch(
        results,
        "stages=[data_preparation]",
        "data_preparation=gpt3/download_gpt3_pile",
        "data_preparation.the_pile_url=http://127.0.0.1:9/unreachable/",
        "data_preparation.download_vocab_url=http://127.0.0.1:9/vocab.json",
        "data_preparation.download_merges_url=http://127.0.0.1:9/merges.txt",
        "dry_run=true",
    )
    assert result.returncode == 0, result.stderr
    assert "nothing was run or submitted" in result.stdout
    folder = results / "download_gpt3_pile"
    assert sorted(p.name for p in folder.iterdir()) == [
        "download_gpt3_pile-download_submission.sh",
        "download_gpt3_pile-download_tokenizer_submission.sh",
        "download_gpt3_pile-extract_submission.sh",
        "download_gpt3_pile-preprocess_submission.sh",
        "download_gpt3_pile_hydra.yaml",
    ]
    assert not (tmp_path / "data").exists()
    assert not (results / "runs").exists()
