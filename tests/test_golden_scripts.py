"""Rendered scripts, byte for byte, for every stage recipe and backend.

After an intended change to a renderer, regenerate with:
    python3 -m pytest tests/test_golden_scripts.py --update-goldens
and review the diff of tests/golden/ like code. A script equal to its stored golden is also
rendered the same from run to run and machine to machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.stages import STAGES, StageContext
from tests.support.golden_cases import GOLDEN, assert_goldens, case_backends, case_overrides


def rendered(case: str, backend_name: str) -> dict[str, str]:
    stage, composed = case_overrides(case, backend_name)
    suffix = ".yaml" if backend_name == "k8s" else ".sh"  # k8s renders manifests
    cfg = resolve(compose_config(composed), [stage])
    backend = BACKENDS[backend_name](cfg)
    jobs = STAGES[stage].jobs(StageContext(cfg, stage))
    return {f"{job.name}{suffix}": backend.render(job) for job in jobs}


@pytest.mark.parametrize(("case", "backend_name"), case_backends(BACKENDS))
def test_rendered_scripts_match_goldens(
    case: str, backend_name: str, update_goldens: bool, tmp_path: Path
) -> None:
    scripts = rendered(case, backend_name)
    assert_goldens(GOLDEN / backend_name / case, scripts, backend_name, update_goldens, tmp_path)


def test_secrets_stay_out_of_scripts() -> None:
    scripts = rendered("custom_dataset_gpt2_bpe", "local")
    for text in scripts.values():
        assert "WANDB_API_KEY_FILE=/secrets/wandb" in text
        assert "WANDB_API_KEY=" not in text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [],
            [
                ("download_tokenizer", None, "singleton"),
                ("download", 30, "singleton"),
                ("extract", 30, "aftercorr"),
                ("preprocess", 30, "aftercorr"),
            ],
        ),
        (
            ["data_preparation.download_the_pile=false"],
            [("download_tokenizer", None, "singleton"), ("preprocess", 30, "singleton")],
        ),
    ],
    ids=["download-extract-preprocess", "preprocess-only"],
)
def test_pile_array_steps_wait_task_by_task(
    overrides: list[str], expected: list[tuple[str, int | None, str]], tmp_path: Path
) -> None:
    """Each array step waits only for its own task of the step before (Slurm's aftercorr)."""
    for number in range(30):  # preprocess-only reads shards already extracted into data_dir
        (tmp_path / f"{number:02d}.jsonl").write_text('{"text": "a"}\n')
    stage = "data_preparation"
    cfg = resolve(
        compose_config(
            [
                f"data_dir={tmp_path}",
                f"stages=[{stage}]",
                "data_preparation=gpt3/download_gpt3_pile",
                *overrides,
            ]
        ),
        [stage],
    )
    jobs = STAGES[stage].jobs(StageContext(cfg, stage))
    assert [(j.name.rsplit("-", 1)[1], j.array_size, j.dependency) for j in jobs] == expected
