"""Fixtures and pytest hooks; the helpers the tests share are in tests/support/.

Regenerate golden scripts with: python3 -m pytest tests/test_golden_scripts.py --update-goldens
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, markers, scheduling, timings
from tests.support.bcp import install_bcprun
from tests.support.commands import run_main
from tests.support.packaging import InstalledLauncher, build_wheel, install_launcher
from tests.support.session_builds import WORDPIECE_DATA, WORDPIECE_VOCAB, built_once
from tests.support.slurm import require_slurm, usable_nodes
from tests.support.triton import server_python

pytest_plugins = ["tests.support.http_site"]  # the `site` fixture: a local HTTP server

# One OpenMP thread for torch in the test processes and in everything they start (job programs,
# tests/scripts, Slurm jobs through sbatch's exported environment), set before anything imports
# torch, whatever the shell had. With torch's default, a thread per core, while the other
# xdist worker keeps a core busy, the threads spin-wait for each other: 60 steps of a small
# model took 9.7 CPU-s (13 s) with two threads against 5.1 (4 s) with one on this 2-core
# machine; a 15 s fine-tuning took 7 minutes on a busy runner. And torchrun gives each of
# several processes one thread: a lone process with the same compares layouts, not matrix
# kernels blocked for different thread counts (seen on CI: a two-thread single process 1.8e-4
# away from the same model on two ranks).
os.environ["OMP_NUM_THREADS"] = "1"


# tryfirst: xdist's worker names each grouped test `<id>@<group>` in its own hook of this name,
# which would otherwise run before this one (its plugin registers after this conftest).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    markers.mark_by_fixtures(items)
    scheduling.assign_xdist_groups(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    timings.start()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PYTEST_TIMINGS=FILE, each test phase's cost is appended to FILE (tests/support/
    timings.py)."""
    timings.record(report)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/ from the current renderers instead of comparing",
    )


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


# ----- real parts: skipped without them, failed in CI (CI=true) -------------------------------


@pytest.fixture(scope="module")
def slurm() -> None:
    """A running Slurm (`.ci/slurm-up.sh` starts one)."""
    require_slurm()


@pytest.fixture(scope="module")
def slurm_nodes(slurm: None) -> list[str]:
    """The usable nodes of the namespace-node partition (at least 3)."""
    return usable_nodes()


@pytest.fixture(scope="session")
def triton_python() -> Path:
    """The python of the Triton server's environment (`launcher_scripts install-triton`)."""
    return server_python()


# ----- data and models a whole run shares, built once (tests read them, write elsewhere) -------


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default data preparation (shipped corpus, trained tokenizer), done once."""

    def build(root: Path) -> None:
        result = run_main(
            "stages=[data_preparation]", f"data_dir={root}/data", f"base_results_dir={root}/results"
        )
        assert result.returncode == 0, result.stdout + result.stderr

    return built_once(tmp_path_factory, "prepared", build)


@pytest.fixture(scope="session")
def prepared_wordpiece(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped corpus prepared for BERT and T5 with the shipped vocabulary, done once. The
    vocabulary sits where the BERT and T5 tiny recipes look for it."""

    def build(root: Path) -> None:
        vocab = root / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.vocab.txt"
        vocab.parent.mkdir(parents=True)
        shutil.copyfile(WORDPIECE_VOCAB, vocab)
        result = run_main(
            "stages=[data_preparation]",
            f"data_dir={root}/data",
            f"base_results_dir={root}/results",
            "data_preparation.train_tokenizer=false",
            f"data_preparation.vocab_file={vocab}",
            *WORDPIECE_DATA,
        )
        assert result.returncode == 0, result.stdout + result.stderr

    return built_once(tmp_path_factory, "prepared_wordpiece", build)


@pytest.fixture(scope="session")
def t5_converted(prepared_wordpiece: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """T5 tiny trained for 100 steps through main.py and converted: the portable file
    (t5_tiny/convert_nemo/megatron_t5.nemo) and its Hugging Face export (.../hf). Returns the
    results root."""

    def build(root: Path) -> None:
        result = run_main(
            "stages=[training,conversion]",
            "training=t5/tiny",
            "conversion=t5/convert_t5",
            "conversion.model.vocab_file=null",
            "conversion.run.hf_dir_name=hf",
            f"data_dir={prepared_wordpiece}/data",
            f"base_results_dir={root}",
            "training.trainer.max_steps=100",
            "training.trainer.log_every_n_steps=5",
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    return built_once(tmp_path_factory, "t5_converted", build)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python3 main.py` as on a fresh machine, shortened: data preparation, training,
    conversion, evaluation on the offline tasks and export. Returns its root (data/, results/)."""
    root = tmp_path_factory.mktemp("default_run")
    result = run_main(
        f"data_dir={root}/data",
        f"base_results_dir={root}/results",
        "training.trainer.max_steps=30",
        "training.trainer.log_every_n_steps=1",
        "training.trainer.val_check_interval=15",
        "training.exp_manager.checkpoint_callback_params.every_n_train_steps=15",
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


@pytest.fixture(scope="session")
def tiny_portable(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT trained briefly and converted: the portable file inference stages read."""

    def build(results: Path) -> None:
        result = run_main(
            "stages=[training,conversion]",
            f"data_dir={prepared}/data",
            f"base_results_dir={results}",
            "training.trainer.max_steps=60",
            "conversion.run.hf_dir_name=null",
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    results = built_once(tmp_path_factory, "tiny_model", build)
    return results / "gpt3_tiny" / "convert_nemo" / "megatron_gpt.nemo"


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped reward-model recipe (rlhf_rm=gpt3/tiny) on the tiny GPT, with the held-out
    pairs as its test set too: its results folder (the reward model is
    checkpoints/megatron_gpt_reward_model.nemo)."""
    validation = REPO / "launcher_scripts" / "sample_data" / "preference_validation.jsonl"

    def build(results: Path) -> None:
        result = run_main(
            "stages=[rlhf_rm]",
            f"base_results_dir={results}",
            f"rlhf_rm.model.pretrained_checkpoint.restore_from_path={tiny_portable}",
            f"rlhf_rm.model.data.data_prefix.test=[{validation}]",
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    results = built_once(tmp_path_factory, "tiny_reward_model", build)
    return results / "gpt3_tiny" / "rlhf_rm" / "results"


@pytest.fixture(scope="session")
def sft_start(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped supervised start of the online tuning stages (fine_tuning=gpt3/tiny): the
    tiny GPT answering the sample prompts with any of four times alike. Its .nemo file."""

    def build(results: Path) -> None:
        result = run_main(
            "stages=[fine_tuning]",
            "fine_tuning=gpt3/tiny",
            f"base_results_dir={results}",
            f"fine_tuning.model.restore_from_path={tiny_portable}",
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    results = built_once(tmp_path_factory, "sft_start", build)
    checkpoints = results / "gpt3_tiny" / "time_answers" / "results" / "checkpoints"
    return checkpoints / "megatron_gpt3_time_answers.nemo"


@pytest.fixture(scope="session")
def exported(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export stage run by main.py on the tiny model; returns its results dir."""
    results = tmp_path_factory.mktemp("export")
    result = run_main(
        "stages=[export]",
        f"base_results_dir={results}",
        f"export.model.nemo_file={tiny_portable}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results / "gpt3_tiny" / "export"


@pytest.fixture(scope="session")
def tp2_export(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Section 5.14.1.3's command (export.model.tensor_model_parallel_size=2,
    export.triton_deployment.pipeline_model_parallel_size=1), which exited 2 before."""
    results = tmp_path_factory.mktemp("tp2_export")
    result = run_main(
        "stages=[export]",
        f"base_results_dir={results}",
        f"export.model.nemo_file={tiny_portable}",
        "export.model.tensor_model_parallel_size=2",
        "export.triton_deployment.pipeline_model_parallel_size=1",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results / "gpt3_tiny" / "export"


# ----- the launcher as a user installs it -----------------------------------------------------


@pytest.fixture(scope="session")
def launcher_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def installed_launcher(
    launcher_wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InstalledLauncher]:
    """Installed once per session (half a minute, mostly pip resolving and unpacking);
    removed at the end: a venv with torch is about 2 GB."""
    installed = install_launcher(launcher_wheel, tmp_path_factory.mktemp("installed") / "venv")
    yield installed
    shutil.rmtree(installed.venv, ignore_errors=True)


@pytest.fixture
def bcp_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine as node 0 of a one-replica BCP job, with the bcprun stand-in on PATH."""
    shim_dir = tmp_path / "shim"
    for name, value in install_bcprun(shim_dir).items():
        monkeypatch.setenv(name, value)
    return shim_dir
