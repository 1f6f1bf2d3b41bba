"""Early stopping (NeMo's exp_manager.create_early_stopping_callback and
early_stopping_callback_params): the run ends when the monitored validation metric stops
improving, writes its outputs as a finished run, and a rerun finds it finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher_scripts.errors import ConfigError
from launcher_scripts.formats.progress import complete_checkpoints
from launcher_scripts.recipes.early_stopping import EarlyStopping, read_early_stopping
from tests.support.commands import assert_one_line_error, run_main
from tests.support.training import val_losses

# Not in the shipped recipes: added with `+`, as Hydra asks.
ENABLED = "+training.exp_manager.create_early_stopping_callback=true"
PARAMS = "+training.exp_manager.early_stopping_callback_params"


def test_the_count_follows_lightnings_rule() -> None:
    stopping = EarlyStopping("val_loss", "min", 0.1, 2, True)
    record: dict = {}
    assert [stopping.update(record, v) for v in (5.0, 4.0, 3.95)] == [None, None, None]
    assert record["best"] == 4.0 and record["wait"] == 1  # 3.95 is not 0.1 better
    reason = stopping.update(record, 4.5)
    assert reason is not None and "for 2 validations (best 4 at step" in reason
    assert stopping.update({}, float("nan")) == "val_loss is nan"


def run(prepared: Path, results: Path, *extra: str):
    return run_main(
        "stages=[training]",
        f"data_dir={prepared}/data",
        f"base_results_dir={results}",
        "training.trainer.max_steps=20",
        "training.trainer.val_check_interval=2",
        "training.trainer.limit_val_batches=1",
        "training.exp_manager.checkpoint_callback_params.every_n_train_steps=20",
        *extra,
    )


def test_a_run_stops_when_its_monitor_stops_improving_and_stays_stopped(
    prepared: Path, tmp_path: Path
) -> None:
    """mode=max on a falling val_loss: the first validation is the best, the next two do not
    improve it, so patience 2 stops the run at step 6 of 20, with a checkpoint there."""
    args = (ENABLED, f"{PARAMS}.mode=max", f"{PARAMS}.patience=2")
    result = run(prepared, tmp_path, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "early stopping at step 6: val_loss has not improved" in result.stdout
    log_dir = tmp_path / "gpt3_tiny" / "results"
    assert sorted(val_losses(log_dir)) == [2, 4, 6]
    (last,) = complete_checkpoints(log_dir / "checkpoints")[-1:]
    assert last.state.step == 6 and "not improved" in last.state.early_stopping["stopped"]
    again = run(prepared, tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training already finished: stopped early at step 6" in again.stdout
    steps = [
        json.loads(line)["step"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(steps) == 6


def test_a_monitor_the_run_does_not_log_stops_it_in_one_line(
    prepared: Path, tmp_path: Path
) -> None:
    result = run(prepared, tmp_path, ENABLED, f"{PARAMS}.monitor=validation_accuracy")
    assert result.returncode != 0
    said = "error: training.exp_manager.early_stopping_callback_params.monitor: "
    said += "validation_accuracy is not a validation metric of this run (it logs: val_loss)"
    assert said in result.stdout, result.stdout[-2000:]  # the job's one line, in its log


@pytest.mark.parametrize(
    ("params", "key", "says"),
    [
        ({"mode": "sideways"}, "mode", "not min or max"),
        ({"min_delta": -1}, "min_delta", ">= 0"),
        ({"patience": 0}, "patience", ">= 1"),
        ({"strict": False}, "strict", "never stop"),
    ],
)
def test_bad_settings_are_one_line(params: dict, key: str, says: str) -> None:
    section = {"create_early_stopping_callback": True, "early_stopping_callback_params": params}
    with pytest.raises(ConfigError) as error:
        read_early_stopping(section, "training")
    assert error.value.key == f"training.exp_manager.early_stopping_callback_params.{key}"
    assert says in str(error.value)


def test_bad_settings_are_refused_before_anything_runs(tmp_path: Path) -> None:
    result = run_main(
        f"base_results_dir={tmp_path}/r",
        "stages=[training]",
        ENABLED,
        f"{PARAMS}.mode=sideways",
        "dry_run=true",
    )
    assert_one_line_error(result, f"{PARAMS.lstrip('+')}.mode", "not min or max")
