"""The AutoConfigurator's inference HP search: a real search on the CPU over the tiny portable
model (TP 1/2 x PP 1/2 x batch 1/4 on two processes; TP=PP=1 through a real Triton server too),
the choice within a latency budget, and bad inputs as one line with exit code 2."""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from auto_configurator.inference.prompts import load_tokenizer
from auto_configurator.inference.report import best_within, ranked
from auto_configurator.inference.runs import Point
from auto_configurator.main import main as autoconfig_main
from launcher_scripts.jobs.export.serve import ServeError, find_server
from tests.support import REPO

SETTINGS = "search_config.inference_settings"
INPUT_LEN, OUTPUT_LEN, REPEATS = 16, 8, 2


def run_autoconfig(*overrides: str) -> subprocess.CompletedProcess:
    """`python3 auto_configurator/main.py overrides...` as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(
        [sys.executable, str(REPO / "auto_configurator" / "main.py"), *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )


def triton_installed() -> bool:
    """Whether the search will serve TP=PP=1 through Triton (serve_with_triton: auto). CI has
    the server (.ci/run installs it); there its absence is a failure."""
    try:
        find_server(None)
    except ServeError as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Triton server for the inference search: {error}")
        return False
    return True


def model_overrides(model: Path, tmp_path: Path) -> list[str]:
    return [
        "search_config=gpt3/tiny",
        "run_inference_hp_search=true",
        f"base_results_dir={tmp_path}",
        f"{SETTINGS}.run.model_file={model}",
    ]


@pytest.fixture(scope="module")
def search(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real search: TP [1, 2] x PP [1, 2] x batch [1, 4] on two CPU processes."""
    results = tmp_path_factory.mktemp("inference_search")
    result = run_autoconfig(
        *model_overrides(tiny_portable, results),
        f"{SETTINGS}.run.tensor_parallel_sizes=[1,2]",
        f"{SETTINGS}.run.pipeline_parallel_sizes=[1,2]",
        f"{SETTINGS}.benchmark.batch_sizes=[1,4]",
        f"{SETTINGS}.benchmark.input_len={INPUT_LEN}",
        f"{SETTINGS}.benchmark.output_len={OUTPUT_LEN}",
        f"{SETTINGS}.benchmark.repeats={REPEATS}",
        f"{SETTINGS}.benchmark.max_latency_ms=[1e-3,1e7]",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = results / "gpt3" / "tiny_2gb" / "inference"
    with open(folder / "final_summary" / "inference_results.csv") as handle:
        rows = list(csv.DictReader(handle))
    # NeMo's name for it (5.3.2.4), beside ours.
    table = (folder / "final_summary" / "final_output.csv").read_text()
    assert table == (folder / "final_summary" / "inference_results.csv").read_text()
    summary = json.loads((folder / "final_summary" / "summary.json").read_text())
    return {"folder": folder, "rows": rows, "summary": summary, "stdout": result.stdout}


def by_key(rows: list[dict[str, str]]) -> dict[tuple[str, int, int, int], dict[str, str]]:
    return {(r["path"], int(r["tp"]), int(r["pp"]), int(r["batch"])): r for r in rows}


def test_every_layout_that_fits_is_measured_through_the_runner(search: dict[str, Any]) -> None:
    rows = by_key(search["rows"])
    for tensor, pipeline in ((1, 1), (2, 1), (1, 2)):
        for batch in (1, 4):
            row = rows[("runner", tensor, pipeline, batch)]
            assert row["status"] == "measured", row
            latency, tokens = float(row["latency_s"]), int(row["generated_tokens"])
            assert latency > 0
            assert 0 < tokens <= batch * OUTPUT_LEN
            assert int(row["gpus"]) == tensor * pipeline
            assert float(row["tokens_per_s"]) == pytest.approx(tokens / latency, rel=1e-3)
            assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(
                tokens / latency / (tensor * pipeline), rel=1e-3
            )
            assert (row["input_len"], row["output_len"]) == (str(INPUT_LEN), str(OUTPUT_LEN))
            assert int(row["repeats"]) == REPEATS
    for batch in (1, 4):  # 4 processes on gpus_per_node 2
        status = rows[("runner", 2, 2, batch)]["status"]
        assert status == "skipped: TP x PP = 4 processes exceed run.gpus_per_node 2"


def test_the_csv_figures_are_the_processes_own(search: dict[str, Any]) -> None:
    """Each runner row is the median of the latencies its TP x PP processes wrote."""
    folder = search["folder"] / "runs"
    for row in search["rows"]:
        if row["path"] != "runner" or row["status"] != "measured":
            continue
        written = json.loads(
            (folder / f"runner_tp{row['tp']}_pp{row['pp']}" / "results.json").read_text()
        )
        assert (written["tensor"], written["pipeline"]) == (int(row["tp"]), int(row["pp"]))
        (entry,) = [e for e in written["batches"] if e["batch"] == int(row["batch"])]
        assert len(entry["latencies_s"]) == REPEATS
        assert float(row["latency_s"]) == pytest.approx(
            statistics.median(entry["latencies_s"]), rel=1e-4
        )


def test_tp1_goes_through_a_real_triton_server_when_one_is_installed(
    search: dict[str, Any],
) -> None:
    rows = by_key(search["rows"])
    triton_rows = [rows.get(("triton", 1, 1, batch)) for batch in (1, 4)]
    if not triton_installed():
        assert triton_rows == [None, None]
        assert "TP=PP=1 through the runner only" in search["stdout"]
        return
    for batch, row in zip((1, 4), triton_rows, strict=True):
        assert row is not None and row["status"] == "measured", row
        assert 0 < int(row["generated_tokens"]) <= batch * OUTPUT_LEN
        assert float(row["latency_s"]) > 0
    served = (search["folder"] / "runs" / "triton_tp1_pp1" / "serve.log").read_text()
    assert re.search(r"ready: models .*\bgpt3_tiny\b", served), served[-2000:]
    # The export stage wrote the repository with room for the largest batch.
    config = search["folder"] / "runs" / "triton_tp1_pp1" / "gpt3_tiny" / "export"
    assert "max_batch_size: 4" in (config / "model_repo" / "gpt3_tiny" / "config.pbtxt").read_text()


def test_results_are_ranked_plotted_and_the_budget_picks_the_best(search: dict[str, Any]) -> None:
    rows, summary = search["rows"], search["summary"]
    measured = [r for r in rows if r["status"] == "measured"]
    per_gpu = [float(r["tokens_per_s_per_gpu"]) for r in measured]
    assert per_gpu == sorted(per_gpu, reverse=True)
    assert rows[: len(measured)] == measured  # the measured rows come first
    best = max(measured, key=lambda r: float(r["tokens_per_s_per_gpu"]))
    assert summary["best_tokens_per_s_per_gpu"]["tokens_per_s_per_gpu"] == pytest.approx(
        float(best["tokens_per_s_per_gpu"]), rel=1e-3
    )
    tight, loose = summary["best_per_latency_budget"]
    assert tight == {"max_latency_ms": 1e-3, "best": None}  # nothing answers in a microsecond
    assert (loose["best"]["path"], loose["best"]["tp"], loose["best"]["batch"]) == (
        best["path"],
        int(best["tp"]),
        int(best["batch"]),
    )
    assert summary["measured"] == len(measured)
    image = search["folder"] / "final_summary" / "inference_results.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "within 0.001 ms: no measured combination" in search["stdout"]


def test_prompts_hold_exactly_input_len_tokens(search: dict[str, Any], tiny_portable: Path) -> None:
    prompts = json.loads((search["folder"] / "prompts.json").read_text())
    assert len(prompts) == 4 and len(set(prompts)) == 4
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = load_tokenizer(tiny_portable, Path(scratch))
        assert [len(tokenizer.encode(p)) for p in prompts] == [INPUT_LEN] * 4


def test_budget_choice_and_ranking() -> None:
    def point(tensor: int, batch: int, latency: float, tokens: int) -> Point:
        return Point("runner", tensor, 1, batch, latencies_s=(latency,), generated_tokens=tokens)

    slow_wide = point(1, 16, 2.0, 320)  # 160 tokens/s per GPU, 2000 ms
    quick = point(1, 1, 0.1, 10)  # 100 per GPU, 100 ms
    split = point(2, 4, 0.2, 60)  # 300 tokens/s over 2 GPUs: 150 per GPU, 200 ms
    failed = Point("runner", 4, 1, 1, status="failed: exit code 1: boom")
    points = [quick, failed, split, slow_wide]
    assert best_within(points, None) is slow_wide
    assert best_within(points, 500) is split
    assert best_within(points, 150) is quick
    assert best_within(points, 50) is None
    assert ranked(points) == [slow_wide, split, quick, failed]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [f"{SETTINGS}.run.tensor_parallel_sizes=[1,3]"],
            f"error: {SETTINGS}.run.tensor_parallel_sizes: TP=3 does not divide the model's 4 "
            "attention heads. List only divisors of the head count",
        ),
        (
            [f"{SETTINGS}.run.pipeline_parallel_sizes=[3]"],
            f"error: {SETTINGS}.run.pipeline_parallel_sizes: PP=3 does not divide the model's 4 "
            "layers. List only divisors of the layer count",
        ),
        (
            [f"{SETTINGS}.benchmark.input_len=120"],
            f"error: {SETTINGS}.benchmark.input_len: input_len 120 + output_len 20 = 140 exceeds "
            "the model's 128 positions. Shorten input_len or output_len",
        ),
        (
            [f"{SETTINGS}.run.data_type=bf16"],
            f"error: {SETTINGS}.run.data_type: bf16 differs from the model file's precision fp32",
        ),
        (
            [
                f"{SETTINGS}.run.tensor_parallel_sizes=[4]",
                f"{SETTINGS}.run.pipeline_parallel_sizes=[1]",
            ],
            f"error: {SETTINGS}.run.gpus_per_node: 2 GPUs hold no layout",
        ),
        (
            [f"{SETTINGS}.benchmark.batch_sizes=[0,4]"],
            f"error: {SETTINGS}.benchmark.batch_sizes: [0, 4] is not a list of positive integers",
        ),
        (
            [f"{SETTINGS}.benchmark.topp=1.5"],
            f"error: {SETTINGS}.benchmark.topp: 1.5 is not a number in [0, 1]",
        ),
        (["cluster_type=bcm"], "error: cluster_type: 'bcm': the inference search measures on"),
    ],
)
def test_bad_inputs_give_one_line_and_exit_2(
    overrides: list[str],
    expected: str,
    tiny_portable: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    code = autoconfig_main([*model_overrides(tiny_portable, tmp_path), *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(expected), err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "gpt3").exists()  # stopped before anything was written


def test_triton_demanded_but_absent_is_one_line(
    tiny_portable: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where `serve` looks: $TRITONSERVER, PATH, then the install-triton venv.
    monkeypatch.delenv("TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LLM_LAUNCHER_TRITON_VENV", str(tmp_path / "no-venv"))
    overrides = model_overrides(tiny_portable, tmp_path)
    code = autoconfig_main([*overrides, f"{SETTINGS}.run.serve_with_triton=true"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip() == (
        f"error: {SETTINGS}.run.serve_with_triton: is true but no Triton server is installed. "
        "Run `python3 -m launcher_scripts install-triton` or put tritonserver on PATH, or set "
        "serve_with_triton=auto"
    )
    assert len(err.strip().splitlines()) == 1


def test_missing_model_file_and_models_without_settings_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "none.nemo"
    code = autoconfig_main(model_overrides(missing, tmp_path))
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        f"error: {SETTINGS}.run.model_file: {missing} does not exist. Convert the trained model "
        "first (the launcher's conversion stage), or point model_file at a portable .nemo file"
    )
    code = autoconfig_main(["search_config=t5/0.22b", "run_inference_hp_search=true"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: {SETTINGS}: is missing from this search config. Use a gpt3 search config (they "
        "have inference_settings) or add the section"
    ]
