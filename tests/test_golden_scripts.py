"""Rendered scripts, byte for byte, for every stage recipe and backend.

After an intended change to a renderer, regenerate with:
    python3 -m pytest tests/test_golden_scripts.py --update-goldens
and review the diff of tests/golden/ like code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.compose import compose_config
from launcher_scripts.config.preflight import resolve
from launcher_scripts.stages import STAGES, StageContext

GOLDEN = Path(__file__).parent / "golden"
# Fixed paths, so the scripts do not depend on where the checkout is.
PATHS = ["launcher_scripts_path=/opt/launcher", "data_dir=/data", "base_results_dir=/results"]
CASES = {
    "custom_dataset_train_tokenizer": (
        "data_preparation",
        [
            "data_preparation=generic/custom_dataset",
            "data_preparation.raw_dataset_files=[/data/raw/a.jsonl,/data/raw/b.jsonl.gz]",
        ],
    ),
    "custom_dataset_hf_tokenizer": (
        "data_preparation",
        [
            "data_preparation=generic/custom_dataset",
            "data_preparation.train_tokenizer=false",
            "data_preparation.tokenizer_model=/data/tok/tokenizer.json",
            'data_preparation.raw_dataset_files=[/data/raw/docs,"/data/raw/it\'s here.json"]',
            "data_preparation.run.workers_per_node=2",
            "data_preparation.append_eod=false",
        ],
    ),
    "custom_dataset_gpt2_bpe": (
        "data_preparation",
        [
            "data_preparation=generic/custom_dataset",
            "data_preparation.train_tokenizer=false",
            "data_preparation.vocab_file=/data/bpe/vocab.json",
            "data_preparation.merge_file=/data/bpe/merges.txt",
            "data_preparation.raw_dataset_files=[/data/raw/a.jsonl]",
            "+env_vars.WANDB_PROJECT=my project",
            "wandb_api_key_file=/secrets/wandb",
        ],
    ),
    "download_gpt3_pile": (
        "data_preparation",
        ["data_preparation=gpt3/download_gpt3_pile", "data_preparation.file_numbers='0,3,5-7'"],
    ),
    "download_t5_pile": (
        "data_preparation",
        ["data_preparation=t5/download_t5_pile", "data_preparation.file_numbers='0,3'"],
    ),
    "download_bert_pile": (
        "data_preparation",
        ["data_preparation=bert/download_bert_pile", "data_preparation.file_numbers='1-2'"],
    ),
    "download_mc4": (
        "data_preparation",
        ["data_preparation=mt5/download_mc4", "data_preparation.languages='cs,da'"],
    ),
    "training_t5_220m": ("training", ["training=t5/220m"]),
    "training_bert_110m": ("training", ["training=bert/110m"]),
    "training_gpt3_tiny": ("training", ["training=gpt3/tiny"]),
    "training_gpt3_126m_container": (
        "training",
        [
            "training=gpt3/126m",
            "container=nvcr.io/nvidia/nemo:24.05",
            "container_mounts=[/lustre/shared,/scratch:/mnt/scratch]",
            # "++": other cluster types' files lack these Slurm keys; their backends ignore them.
            "++cluster.partition=batch",
            "++cluster.account=llm",
            "++cluster.sbatch_options.constraint=h100",
            "++cluster.srun_args=['--mpi=pmix']",
        ],
    ),
    "conversion_gpt3": ("conversion", ["conversion.run.model_train_name=gpt3_126m"]),
    "evaluation_gpt3_tp2": (
        "evaluation",
        [
            "training=gpt3/126m",
            "evaluation.model.tensor_model_parallel_size=2",
            "evaluation.run.tasks=all_tasks",
        ],
    ),
    "export_gpt3": ("export", ["export.run.model_train_name=gpt3_126m"]),
    "sft_squad": ("data_preparation", ["data_preparation=sft/squad"]),
    "sft_dolly": ("data_preparation", ["data_preparation=sft/dolly"]),
    "fine_tuning_gpt3_squad": ("fine_tuning", ["fine_tuning=gpt3/squad"]),
    "peft_gpt3_lora_tp2": (
        "peft",
        [
            "peft=gpt3/squad",
            "peft.trainer.devices=2",
            "peft.model.tensor_model_parallel_size=2",
            "peft.model.peft.peft_scheme=lora",
        ],
    ),
    "prompt_learning_gpt3": ("prompt_learning", ["prompt_learning=gpt3/squad"]),
    "adapter_learning_gpt3": ("adapter_learning", ["adapter_learning=gpt3/squad"]),
    "ia3_learning_gpt3": ("ia3_learning", ["ia3_learning=gpt3/squad"]),
    "evaluation_peft_gpt3": ("evaluation", ["evaluation=peft_gpt3/squad"]),
    "training_gpt3_126m_two_devices": (
        "training",
        ["training=gpt3/126m", "training.trainer.devices=2", "training.trainer.num_nodes=1"],
    ),
}


# What the k8s backend needs besides a case: an image, and volumes holding the fixed paths (one
# of each kind of source).
K8S = [
    "cluster.volumes=[{name:code,mount_path:/opt/launcher,host_path:/opt/launcher},"
    "{name:data,mount_path:/data,pvc:launcher-data},"
    "{name:results,mount_path:/results,nfs:{server:nfs.example.com,path:/export/results}}]",
]


def rendered(case: str, backend_name: str) -> dict[str, str]:
    stage, overrides = CASES[case]
    extra, suffix = [], ".sh"
    if backend_name == "k8s":  # manifests, named .yaml
        extra, suffix = list(K8S), ".yaml"
        if not any(o.startswith("container=") for o in overrides):
            extra.append("container=nvcr.io/nvidia/nemo:24.05")
    composed = [*PATHS, f"cluster_type={backend_name}", *extra, f"stages=[{stage}]", *overrides]
    cfg = resolve(compose_config(composed), [stage])
    backend = BACKENDS[backend_name](cfg)
    jobs = STAGES[stage].jobs(StageContext(cfg, stage))
    return {f"{job.name}{suffix}": backend.render(job) for job in jobs}


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_scripts_match_goldens(
    case: str, backend_name: str, update_goldens: bool, tmp_path: Path
) -> None:
    scripts = rendered(case, backend_name)
    folder = GOLDEN / backend_name / case
    if update_goldens:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, text in scripts.items():
            (folder / name).write_text(text)
    pattern = "*.yaml" if backend_name == "k8s" else "*.sh"
    expected = sorted(p.name for p in folder.glob(pattern))
    assert sorted(scripts) == expected, "jobs differ from the goldens; see --update-goldens"
    for name, text in scripts.items():
        assert text == (folder / name).read_text(), f"{folder / name} differs"
        if backend_name == "k8s":  # a manifest: valid against the pinned Kubernetes schemas
            from tests.k8s_schema import validate_manifest

            validate_manifest(text)
            continue
        script = tmp_path / name
        script.write_text(text)
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        if shutil.which("shellcheck") or os.environ.get("CI") == "true":
            assert shutil.which("shellcheck"), "CI must install shellcheck (.ci/run does)"
            lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout


def test_rendering_is_deterministic() -> None:
    for case in CASES:
        assert rendered(case, "local") == rendered(case, "local")


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
