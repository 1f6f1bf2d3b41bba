"""The local backend runs what it renders: plain python, or torchrun for several processes."""

from __future__ import annotations

from pathlib import Path

from launcher_scripts.clusters import JobRecord
from launcher_scripts.clusters.local import LocalBackend
from launcher_scripts.jobspec import Command, JobSpec
from tests.support import REPO

PROGRAM = """
import os, sys
print(f"rank {os.environ.get('RANK', '-')} of {os.environ.get('WORLD_SIZE', '-')}: {sys.argv[1:]}")
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def run_job(tmp_path: Path, *commands: Command, env: tuple = ()) -> tuple[JobRecord, str]:
    (tmp_path / "hello_job.py").write_text(PROGRAM)
    job = JobSpec(
        stage="test",
        name="hello",
        results_dir=str(tmp_path),
        commands=commands,
        env=env,
        pythonpath=f"{tmp_path}:{REPO}",
    )
    backend = LocalBackend()
    script = tmp_path / "hello.sh"
    script.write_text(backend.render(job))
    record = JobRecord("hello", "test", "local", str(script), backend.log_path(job, "run1"))
    started: list[str] = []
    backend.submit(str(script), job, record, [], lambda r: started.append(r.state))
    assert started == ["RUNNING"]
    return record, Path(record.log).read_text()


def test_single_process_job_gets_its_arguments_quoted(tmp_path: Path) -> None:
    record, log = run_job(tmp_path, Command("hello_job", ("a b", "it's", "$HOME")))
    assert record.state == "COMPLETED" and record.exit_code == 0
    assert "rank - of -: ['a b', \"it's\", '$HOME']" in log


def test_multi_process_job_runs_under_torchrun(tmp_path: Path) -> None:
    record, log = run_job(tmp_path, Command("hello_job", ("x",), nproc_per_node=2))
    assert "--nproc-per-node=2" in Path(record.script).read_text()
    assert record.state == "COMPLETED", log
    assert "rank 0 of 2: ['x']" in log and "rank 1 of 2: ['x']" in log


def test_commands_run_in_order_and_a_failure_ends_the_job(tmp_path: Path) -> None:
    record, log = run_job(
        tmp_path,
        Command("hello_job", ("first",)),
        Command("hello_job", ("second",)),
        env=(("EXIT_WITH", "3"),),
    )
    assert record.state == "FAILED" and record.exit_code == 3
    assert "['first']" in log and "['second']" not in log
    assert record.start and record.end and record.job_ids == [f"local-{record.pid}"]
