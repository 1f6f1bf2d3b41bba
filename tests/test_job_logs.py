"""Job logs start with the job's own output, not with megatron-core's and torch's warnings that
ask nothing of the user; LAUNCHER_SHOW_ALL_WARNINGS=1 brings them back."""

from __future__ import annotations

import re
from pathlib import Path

from launcher_scripts.jobs.benign_warnings import BENIGN_LOG_LINES, BENIGN_WARNINGS
from tests.support.commands import run_main

# Any line a Python warning or a WARNING log record prints.
WARNING_LINE = re.compile(r"\b\w*Warning: |^\s*warnings\.warn\(|WARNING")
STAGES = ("training", "conversion", "export")


def run_jobs(prepared: Path, results: Path, *overrides: str) -> dict[str, str]:
    """Training, conversion and export of the tiny model; each job's log text by stage."""
    result = run_main(
        f"stages=[{','.join(STAGES)}]",
        f"data_dir={prepared}/data",
        f"base_results_dir={results}",
        "training.trainer.max_steps=4",
        "training.model.optim.sched.warmup_steps=1",
        "training.trainer.val_check_interval=2",
        "conversion.run.hf_dir_name=null",
        *overrides,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folders = {
        "training": results / "gpt3_tiny",
        "conversion": results / "gpt3_tiny" / "convert_nemo",
        "export": results / "gpt3_tiny" / "export",
    }
    logs = {}
    for stage, folder in folders.items():
        (log,) = folder.glob("log-*.out")
        logs[stage] = log.read_text()
    return logs


def test_job_logs_hold_no_benign_warnings_unless_asked(
    default_run: Path, prepared: Path, tmp_path: Path
) -> None:
    # The quiet side: every job log of the default `python3 main.py` run.
    quiet = {log.name: log.read_text() for log in default_run.rglob("log-*.out")}
    # tokenizer, preprocessing, training, conversion, evaluation, export
    assert len(quiet) == 6, sorted(quiet)
    for stage, log in quiet.items():
        warned = [line for line in log.splitlines() if WARNING_LINE.search(line)]
        assert not warned, (stage, warned)
        assert not any(
            re.search(message, log) for _category, message, _module in BENIGN_WARNINGS
        ), stage
        # Helpers that end with the job (the resource tracker of training's saves) are not
        # reported as processes it left running.
        assert "launcher: the job's main process ended" not in log, stage

    loud = run_jobs(prepared, tmp_path, "+env_vars.LAUNCHER_SHOW_ALL_WARNINGS=1")
    for stage, log in loud.items():
        assert "UserWarning: Transformer Engine and Apex are not installed" in log, stage
    assert "Implicit initialization of Rerun State Machine!" in loud["training"]
    shown = [
        pattern
        for pattern in (m for _c, m, _mod in BENIGN_WARNINGS)
        if any(re.search(pattern, log) for log in loud.values())
    ] + [
        pattern
        for patterns in BENIGN_LOG_LINES.values()
        for pattern in patterns
        if any(re.search(pattern, log) for log in loud.values())
    ]
    # Every filter silences something these jobs print: none is dead weight.
    assert len(shown) == len(BENIGN_WARNINGS) + sum(map(len, BENIGN_LOG_LINES.values())), shown
