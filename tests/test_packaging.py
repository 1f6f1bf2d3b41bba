"""The launcher as `pip install` leaves it: the wheel holds every package and data file, and the
installed launcher, run from a folder outside the checkout, dry-runs every stage on every
backend, prepares data and trains the tiny model, writing under the current folder (never
into site-packages). The installed venv has no wandb: W&B settings are refused there, in
preflight or, for jobs in a container, at the job's start, in one line.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.recipes.tuning import TUNING_STAGES
from launcher_scripts.stages import STAGES
from tests.support import REPO
from tests.support.packaging import InstalledLauncher, source_files

# Top-level folders of the checkout that are not installed, by design. Every other file below a
# folder ships (conf/ as launcher_scripts/conf/); a new folder must be added to setup.py's
# SHIPPED or here.
NOT_SHIPPED = {
    "tests": "the test suite",
    "bench": "developers' benchmarks, run from a checkout",
    "docs": "the documentation, read where the source is published",
    ".ci": "CI's own scripts",
}
INSTALLED_AS = {"conf": "launcher_scripts/conf"}
IMAGE = "nvcr.io/nvidia/nemo:24.05"  # rendered only: no container runs here
WANDB_KEY = "exp_manager.create_wandb_logger"


def installed_name(source: str) -> str | None:
    """Where a checkout file sits in the wheel; None for files that do not ship."""
    top, sep, rest = source.partition("/")
    if not sep or top in NOT_SHIPPED:
        return None  # top-level files: main.py (llm-launcher replaces it), setup.py, README...
    return f"{INSTALLED_AS.get(top, top)}/{rest}"


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_every_package_and_data_file_is_in_the_wheel(launcher_wheel: Path) -> None:
    names = wheel_names(launcher_wheel)
    expected = {n for n in map(installed_name, source_files()) if n and "__pycache__" not in n}
    assert {"launcher_scripts/jobs/fine_tuning/tuner.py", "launcher_scripts/conf/config.yaml"} <= (
        expected
    )
    missing = sorted(expected - names)
    assert not missing, f"{len(missing)} files missing from the wheel, e.g. {missing[:10]}"


def test_the_wheel_offers_wandb_as_an_extra(launcher_wheel: Path) -> None:
    with zipfile.ZipFile(launcher_wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert "Provides-Extra: wandb" in text
    assert re.search(r"^Requires-Dist: wandb\b.*extra == .wandb.", text, re.MULTILINE), text


def outside(tmp_path: Path) -> Path:
    """A fresh folder outside the checkout to run the installed launcher from."""
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def assert_site_packages_untouched(installed: InstalledLauncher) -> None:
    site = installed.site_packages()
    assert not (site / "data").exists() and not (site / "results").exists()


def test_the_installed_launcher_imports_its_own_code(
    installed_launcher: InstalledLauncher, tmp_path: Path
) -> None:
    probe = "import launcher_scripts, sys; print(launcher_scripts.__file__)"
    result = installed_launcher.run(["python", "-c", probe], outside(tmp_path))
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(installed_launcher.site_packages())


def stage_configs(stdout: str) -> dict[str, Path]:
    """`stage X: config PATH` lines of a dry run."""
    return {m[1]: Path(m[2]) for m in re.finditer(r"^stage (\S+): config (\S+)$", stdout, re.M)}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_dry_runs_from_the_installed_launcher(
    installed_launcher: InstalledLauncher, tmp_path: Path, stage: str
) -> None:
    work = outside(tmp_path)
    result = installed_launcher.run(["llm-launcher", f"stages=[{stage}]", "dry_run=true"], work)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "dry run: every script is rendered" in result.stdout
    (config,) = stage_configs(result.stdout).values()
    assert config.is_relative_to(work / "results") and config.is_file()
    assert not (work / "data").exists()  # a dry run writes no data
    assert_site_packages_untouched(installed_launcher)


@pytest.mark.parametrize("cluster_type", sorted(set(BACKENDS) - {"local"}))
def test_every_stage_renders_for_each_cluster_from_the_installed_launcher(
    installed_launcher: InstalledLauncher, tmp_path: Path, cluster_type: str
) -> None:
    work = outside(tmp_path)
    argv = ["llm-launcher", f"stages=[{','.join(STAGES)}]", f"cluster_type={cluster_type}"]
    argv += [f"container={IMAGE}", "dry_run=true"]
    if cluster_type == "k8s":  # pods see only volumes: the installed code and the work folder
        volumes = [("code", installed_launcher.site_packages()), ("work", work)]
        entries = [f"{{name:{n},mount_path:'{p}',host_path:'{p}'}}" for n, p in volumes]
        argv.append(f"cluster.volumes=[{','.join(entries)}]")
    result = installed_launcher.run(argv, work)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    configs = stage_configs(result.stdout)
    assert set(configs) == set(STAGES)
    # The jobs run the installed code: it is what the scripts put on PYTHONPATH.
    site = str(installed_launcher.site_packages())
    scripts = [p for p in (work / "results").rglob("*") if p.suffix in (".sh", ".yaml")]
    assert any(site in p.read_text() for p in scripts if "hydra" not in p.name)
    assert_site_packages_untouched(installed_launcher)


def test_the_installed_launcher_prepares_data_and_trains_the_tiny_model(
    installed_launcher: InstalledLauncher, tmp_path: Path
) -> None:
    work = outside(tmp_path)
    argv = ["llm-launcher", "stages=[data_preparation,training]", "training.trainer.max_steps=3"]
    argv.append("training.model.optim.sched.warmup_steps=1")
    result = installed_launcher.run(argv, work, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Under the current folder by default, as README says for an installed launcher.
    assert list((work / "data" / "custom_dataset" / "preprocessed").glob("*.idx"))
    log_dir = work / "results" / "gpt3_tiny" / "results"
    assert [p for p in (log_dir / "checkpoints").iterdir() if "step=3" in p.name]
    assert (log_dir / "metrics.jsonl").read_text().strip()
    assert_site_packages_untouched(installed_launcher)
    status = installed_launcher.run(["python", "-m", "launcher_scripts", "status", "results"], work)
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout + status.stderr
    # The console command takes the same commands as `python3 -m launcher_scripts`.
    assert installed_launcher.run(["llm-launcher", "status", "results"], work).stdout == (
        status.stdout
    )
    # Given no folder, status reads the default base_results_dir: ./results here.
    default = installed_launcher.run(["llm-launcher", "status"], work).stdout
    here = installed_launcher.run(["llm-launcher", "status", str(work.resolve() / "results")], work)
    assert default == here.stdout and "COMPLETED" in default, default
    typo = installed_launcher.run(["llm-launcher", "stauts", "results"], work)
    assert typo.returncode == 2 and "did you mean 'status'" in typo.stderr, typo.stderr


def stages_reading_wandb() -> list[str]:
    """The stages whose recipes have exp_manager.create_wandb_logger (their jobs read it)."""
    cfg = compose_config([f"stages=[{','.join(sorted(STAGES))}]"])  # every stage's recipe
    found = []
    for stage in sorted(STAGES):
        exp_manager = cfg[stage].get("exp_manager") or {}
        if "create_wandb_logger" in exp_manager:
            found.append(stage)
    return found


def test_stages_reading_wandb_are_the_training_and_tuning_stages() -> None:
    assert {"training", *TUNING_STAGES} == set(stages_reading_wandb())


def test_the_installed_venv_has_no_wandb(
    installed_launcher: InstalledLauncher, tmp_path: Path
) -> None:
    """What the W&B tests below rely on: a real `import wandb` fails there."""
    result = installed_launcher.run(["python", "-c", "import wandb"], outside(tmp_path))
    assert result.returncode == 1 and "No module named 'wandb'" in result.stderr


@pytest.mark.parametrize("dry_run", ["true", "false"])
@pytest.mark.parametrize("stage", stages_reading_wandb())
def test_wandb_logging_without_wandb_is_refused_in_preflight(
    installed_launcher: InstalledLauncher, tmp_path: Path, stage: str, dry_run: str
) -> None:
    work = outside(tmp_path)
    argv = ["llm-launcher", f"stages=[{stage}]", f"{stage}.{WANDB_KEY}=True", f"dry_run={dry_run}"]
    result = installed_launcher.run(argv, work)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {stage}.{WANDB_KEY}:"), lines
    assert "pip install" in lines[0]
    assert not any(work.iterdir()), "nothing may be written"


def test_jobs_in_a_container_without_wandb_fail_at_start_in_one_line(
    installed_launcher: InstalledLauncher, tmp_path: Path
) -> None:
    """The launcher's environment is not a container's: preflight lets the run through, and
    each job program, run as the container runs it, stops at its start with one line."""
    work = outside(tmp_path)
    # Each job program that reads the key once: pretraining, and fine-tuning (which every
    # tuning stage runs; preflight's refusal above is tested for each stage).
    stages = ["training", "peft"]
    argv = ["llm-launcher", f"stages=[{','.join(stages)}]", "cluster_type=bcm"]
    argv += [f"container={IMAGE}", "dry_run=true", *(f"{s}.{WANDB_KEY}=True" for s in stages)]
    result = installed_launcher.run(argv, work)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    configs = stage_configs(result.stdout)
    for stage in stages:
        if stage == "training":
            program = ["-m", "launcher_scripts.jobs.training.pretrain"]
        else:
            program = ["-m", "launcher_scripts.jobs.fine_tuning.finetune", "--stage", stage]
        job = installed_launcher.run(["python", *program, "--config", str(configs[stage])], work)
        output = job.stdout + job.stderr
        assert job.returncode == 1, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"{stage}.{WANDB_KEY} is true but wandb" in errors[0], output


def test_a_checkout_keeps_data_and_results_in_the_checkout_wherever_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an installed launcher writes under the current folder; a checkout's defaults stay."""
    monkeypatch.chdir(tmp_path)
    resolved = resolve(compose_config([]), ["training"])
    assert resolved.launcher_scripts_path == str(REPO)
    assert resolved.data_dir == f"{REPO}/data"
    assert resolved.base_results_dir == f"{REPO}/results"
