"""`python3 -m launcher_scripts ...`: the command word, and status/logs/cancel on a manifest that
cannot be read. Each gets one line naming the file or the commands, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from launcher_scripts import ops
from launcher_scripts.clusters.base import JobRecord
from launcher_scripts.main import COMMANDS as EVERY_COMMAND
from launcher_scripts.manifest import MANIFEST, STAGE_LINK, Manifest, StageRecord
from tests.support import REPO
from tests.support.commands import run_ops

COMMANDS = ("status", "logs", "cancel")
# Values of a type no manifest field has: each replaces every key in turn.
WRONG_VALUES = ({"bad": 1}, [1], True)
REQUIRED = {
    place: {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    for place, cls in (("run", Manifest), ("stage", StageRecord), ("job", JobRecord))
}


def write_manifest(root: Path) -> Path:
    """A finished one-job local run, written by the launcher's own Manifest.save."""
    run_dir = root / "runs" / "r1"
    log = root / "stage" / "log-job.out"
    log.parent.mkdir(parents=True)
    log.write_text("the job's output\n")
    job = JobRecord(
        name="job",
        stage="data_preparation",
        backend="local",
        script=str(root / "stage" / "job.sh"),
        log=str(log),
        state="COMPLETED",
        job_ids=["local-1"],
        exit_code=0,
        start="2026-01-01T00:00:00+00:00",
        end="2026-01-01T00:01:00+00:00",
        pid=1,
    )
    stage = StageRecord("data_preparation", str(root / "stage"), "c.yaml", [job], ["a"])
    manifest = Manifest(
        run_id="r1",
        path=run_dir / MANIFEST,
        created="r1",
        command=["main.py"],
        cluster_type="local",
        git_revision=None,
        launcher_pid=1,
        stages=[stage],
    )
    manifest.save()
    manifest.link_stage_dirs()
    return manifest.path


@pytest.mark.parametrize("command", ["status", "logs"])
def test_a_reader_that_has_gone_ends_the_command_quietly(command: str, tmp_path: Path) -> None:
    """`status | head`: the pipe's reader is gone before the command writes."""
    write_manifest(tmp_path)
    reader, writer = os.pipe()
    os.close(reader)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "launcher_scripts", command, str(tmp_path)],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=300,
        )
    finally:
        os.close(writer)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    assert result.stderr == ""


def damaged_manifests(text: str) -> Iterator[tuple[str, str | bytes]]:
    """(what, file content) for every way to damage the manifest `text`: truncated anywhere,
    not text, and every key of the run, of a stage and of a job missing or of a wrong type."""
    for cut in range(0, len(text) - 1, max(1, len(text) // 9)):
        yield f"truncated at {cut}", text[:cut]
    yield "not text", b"\xff\xfe\x00\x01garbage"
    yield "a list", "[]"
    data = json.loads(text)
    places = [("run", data), ("stage", data["stages"][0]), ("job", data["stages"][0]["jobs"][0])]
    for place, record in places:
        for key in list(record):
            kept = record[key]
            del record[key]
            # Keys with a default may be left out (older manifests lack newer keys).
            if key in REQUIRED[place]:
                yield f"{place} without {key}", json.dumps(data)
            for wrong in WRONG_VALUES:
                record[key] = wrong
                yield f"{place} {key}={wrong!r}", json.dumps(data)
            record[key] = kept
    data["stages"][0]["jobs"][0]["backend"] = "nowhere"
    yield "unknown backend", json.dumps(data)
    data["stages"][0]["jobs"][0]["backend"] = "local"
    data["stages"][0]["extra"] = 1
    yield "unknown key", json.dumps(data)


def one_error_line(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_damaged_manifest_gets_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_manifest(tmp_path)
    good = path.read_text()
    for command in COMMANDS:
        assert ops.main([command, str(path.parent)]) == 0
    capsys.readouterr()
    (path.parent / "cancel_requested").unlink()
    cases = list(damaged_manifests(good))
    assert len(cases) > 60
    for what, content in cases:
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        for command in COMMANDS:
            # Through the stage's link too: it is how users usually name a run.
            for target in (path.parent, tmp_path / "stage"):
                code = ops.main([command, str(target)])
                out, err = capsys.readouterr()
                try:
                    one_error_line(code, out, err, str(path), "restore it")
                except AssertionError as error:
                    raise AssertionError(f"{what}, {command}: {error}") from None
        assert not (path.parent / "cancel_requested").exists(), what
        assert path.read_bytes() == (content if isinstance(content, bytes) else content.encode())


def test_status_logs_cancel_of_a_damaged_manifest_print_one_line(tmp_path: Path) -> None:
    """The same, end to end: the module as users run it."""
    path = write_manifest(tmp_path)
    path.write_text(path.read_text()[:100])
    for command in COMMANDS:
        result = run_ops(command, str(tmp_path / "stage"))
        one_error_line(result.returncode, result.stdout, result.stderr, str(path))


def test_a_link_to_a_deleted_run_gets_one_line(tmp_path: Path) -> None:
    path = write_manifest(tmp_path)
    path.unlink()
    path.parent.rmdir()
    link = tmp_path / "stage" / STAGE_LINK
    for command in COMMANDS:
        result = run_ops(command, str(tmp_path / "stage"))
        one_error_line(
            result.returncode, result.stdout, result.stderr, str(link), str(path), "does not exist"
        )


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher_scripts", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )


@pytest.mark.parametrize(
    ("word", "meant"),
    [
        ("stauts", "status"),
        ("stats", "status"),
        ("log", "logs"),
        ("cancle", "cancel"),
        ("serv", "serve"),
        ("merge_lora", "merge-lora"),
        ("install-triton2", "install-triton"),
        ("launch", None),
        ("results/x", None),
    ],
)
def test_an_unknown_command_lists_the_commands(word: str, meant: str | None) -> None:
    result = run_module(word, "results/x")
    one_error_line(
        result.returncode,
        result.stdout,
        result.stderr,
        f"unknown command {word!r}",
        ", ".join(EVERY_COMMAND),
    )
    if meant:
        assert f"did you mean {meant!r}" in result.stderr
    else:
        assert "did you mean" not in result.stderr


@pytest.mark.parametrize("command", ["status results", "logs results training", "serve x"])
def test_a_command_given_to_main_py_names_the_module_that_runs_it(command: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *command.split()],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    word = command.split()[0]
    one_error_line(
        result.returncode,
        result.stdout,
        result.stderr,
        f"{word} is a command, not an override: run python3 -m launcher_scripts {command} ",
    )


@pytest.mark.parametrize(
    "first",
    ["stages=[data_preparation]", "+env_vars.LAUNCHER_TEST=1", "~cluster", "--help", "-h"],
)
def test_overrides_still_launch_as_main_py(first: str, tmp_path: Path) -> None:
    """Overrides (key=value, +key=value, ~key) and flags go to main.py, as before."""
    args = [first, "stages=[data_preparation]", "dry_run=true", f"base_results_dir={tmp_path}"]
    module = run_module(*args)
    main = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert "unknown command" not in module.stderr
    assert module.returncode == main.returncode
    assert module.stderr.splitlines()[:1] == main.stderr.splitlines()[:1]
