"""`model.nsys_profile` (NeMo's section of every training recipe): honoured or refused in one line.

Nsight Systems needs a GPU and is not installable here, so the end-to-end capture is a GPU
check (bench/gpu). These tests cover what runs here: the section's checks, the rendered
command on every backend, and the wrapper program on real processes. Its `nsys` is a stand-in
script that writes the argv it was given and runs the program after it, so the test sees the
exact nsys command line and that the program runs under it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_scripts import pipeline
from launcher_scripts.clusters import BACKENDS
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.refusal import EXIT_REFUSED
from launcher_scripts.recipes.profiling import PROFILED
from tests.support import REPO
from tests.support.dry_runs import without_slurm

GPU_RUN = ("stages=[training]", "training=gpt3/126m", "training.trainer.num_nodes=1")
ENABLED = "training.model.nsys_profile.enabled=true"


def planned(tmp_path: Path, *overrides: str):
    args = [f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "dry_run=true"]
    return pipeline.plan(pipeline.compose([*args, *GPU_RUN, *overrides]))


def refusal(tmp_path: Path, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        planned(tmp_path, ENABLED, "cluster_type=bcm", *overrides)
    return error.value


@pytest.mark.parametrize("cluster_type", sorted(BACKENDS))
def test_enabled_wraps_the_training_program_on_every_backend(
    cluster_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_slurm(monkeypatch)
    extra = [] if cluster_type == "local" else ["container=nvcr.io/nvidia/nemo:24.05"]
    if cluster_type == "k8s":
        extra.append("cluster.volumes=[{name: all, mount_path: /, host_path: /}]")
    profile = (
        "training.model.nsys_profile.ranks=[0,3]",
        "training.model.nsys_profile.trace=[cuda,nvtx,cudnn]",
    )
    _, resolved, stages = planned(
        tmp_path, ENABLED, f"cluster_type={cluster_type}", *profile, *extra
    )
    (job,) = stages[0].jobs
    script = job.script
    log_dir = Path(str(resolved.training.exp_manager.explicit_log_dir))
    assert PROFILED in script and "--ranks=0,3" in script and "--trace=cuda,nvtx,cudnn" in script
    assert f"--output={log_dir / 'nsys_profile'}" in script
    assert "launcher_scripts.jobs.training.pretrain" in script
    # Off (the recipes' default), the program starts as before.
    _, _, plain = planned(tmp_path, f"cluster_type={cluster_type}", *extra)
    assert PROFILED not in plain[0].jobs[0].script


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (("training.model.nsys_profile.end_step=5",), "end_step", "before start_step 10"),
        (("training.model.nsys_profile.ranks=[8]",), "ranks[0]", "not a rank of this run"),
        (("training.model.nsys_profile.trace=[cuda,nvtxx]",), "trace[1]", "not an nsys trace"),
        (
            (
                "training.model.nsys_profile.trace=[cuda]",
                "training.model.nsys_profile.gen_shape=true",
            ),
            "gen_shape",
            "no nvtx",
        ),
        (
            (
                "training.model.nsys_profile.start_step=600001",
                "training.model.nsys_profile.end_step=600002",
            ),
            "start_step",
            "after the last step",
        ),
        (("training.model.nsys_profile.enabled=maybe",), "enabled", "not true or false"),
    ],
)
def test_a_bad_profile_section_is_refused_in_one_line(
    overrides: tuple[str, ...], key: str, says: str, tmp_path: Path
) -> None:
    error = refusal(tmp_path, *overrides)
    assert error.key == f"training.model.nsys_profile.{key}", error
    assert says in str(error)


def test_profiling_a_cpu_run_is_refused(tmp_path: Path) -> None:
    """The capture opens with CUDA's profiler API: on CPUs it would record nothing."""
    args = [f"base_results_dir={tmp_path}/r", "stages=[training]", ENABLED, "dry_run=true"]
    with pytest.raises(ConfigError) as error:
        pipeline.plan(pipeline.compose(args))
    assert error.value.key == "training.model.nsys_profile.enabled"
    assert "CPUs" in str(error.value)


# ----- the wrapper program, on real processes ------------------------------------------------

STAND_IN_NSYS = """#!/usr/bin/env bash
# A stand-in for nsys, for tests: writes its argv, then runs the program after the options.
printf '%s\\n' "$@" > "$NSYS_ARGV_FILE"
shift  # profile
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


def wrapper(tmp_path: Path, rank: int, path: str) -> subprocess.CompletedProcess:
    """The wrapper on rank `rank` of 4, running a program that leaves a marker file."""
    # A module per rank: one file rewritten within a second could be run from its stale
    # bytecode cache.
    (tmp_path / f"marked{rank}.py").write_text(
        f"import pathlib\npathlib.Path({str(tmp_path)!r}, 'ran-{rank}').write_text('ran')\n"
    )
    env = {
        **os.environ,
        "PATH": path,
        "RANK": str(rank),
        "WORLD_SIZE": "4",
        "NSYS_ARGV_FILE": str(tmp_path / f"argv-{rank}"),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]),
    }
    argv = [sys.executable, "-m", PROFILED, "--ranks=0,3", "--trace=cuda,nvtx"]
    argv += [f"--output={tmp_path / 'reports'}", "--", f"marked{rank}"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_a_listed_rank_runs_under_nsys_and_the_others_do_not(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(STAND_IN_NSYS)
    nsys.chmod(nsys.stat().st_mode | stat.S_IEXEC)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    for rank in (0, 1, 3):
        result = wrapper(tmp_path, rank, path)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / f"ran-{rank}").read_text() == "ran"
    argv = (tmp_path / "argv-0").read_text().splitlines()
    assert argv[0] == "profile" and "--capture-range=cudaProfilerApi" in argv
    assert "--capture-range-end=stop" in argv and "--trace=cuda,nvtx" in argv
    assert f"--output={tmp_path / 'reports' / 'profile_rank0'}" in argv
    assert argv[-3:] == ["-u", "-m", "marked0"]
    assert (tmp_path / "argv-3").is_file() and not (tmp_path / "argv-1").exists()


def test_a_node_without_nsys_stops_the_job_in_one_line(tmp_path: Path) -> None:
    path = str(Path(sys.executable).parent) + os.pathsep + "/usr/bin:/bin"
    if any((Path(d) / "nsys").exists() for d in path.split(os.pathsep)):
        pytest.skip("nsys is installed here")
    result = wrapper(tmp_path, 0, path)
    assert result.returncode == EXIT_REFUSED
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: training.model.nsys_profile"), lines
    assert "nsys (Nsight Systems) is not on PATH" in lines[0]
    assert not (tmp_path / "ran-0").exists()
    # A rank nsys does not profile goes on without it.
    assert wrapper(tmp_path, 1, path).returncode == 0
