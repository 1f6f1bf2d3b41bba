"""One case per kind of job a stage renders, composed for every backend: the golden scripts and
the quoting tests render each of them."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

GOLDEN = Path(__file__).parents[1] / "golden"

# Fixed paths, so the scripts do not depend on where the checkout is.
PATHS = ["launcher_scripts_path=/opt/launcher", "data_dir=/data", "base_results_dir=/results"]
# One case per kind of job a stage renders: (stage, overrides). The golden scripts and the
# quoting tests render each of them for every backend.
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
    "data_curation_jsonl": (
        "data_curation",
        [
            "data_curation.source.files=[/data/raw/web]",
            "data_curation.tasks=8",
            "data_curation.run.node_array_size=4",
            "data_curation.steps=[clean,language,heuristics,decontamination]",
            "data_curation.decontamination.task_files=[/data/tasks/squad_dev.jsonl]",
        ],
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
            # Slurm's own keys: case_overrides gives them to the bcm backend only (another
            # cluster type's file has no such keys, and preflight refuses them there).
            "++cluster.partition=batch",
            "++cluster.account=llm",
            "++cluster.sbatch_options.constraint=h100",
            "++cluster.srun_args=['--mpi=pmix']",
        ],
    ),
    # Before the other conversion cases: a stage's last case is the one its name checks use.
    "hf_import_t5": (
        "conversion",
        ["conversion=hf_import", "conversion.hf_model_dir=/data/hf/t5-small"],
    ),
    "conversion_gpt3": ("conversion", ["conversion.run.model_train_name=gpt3_126m"]),
    "conversion_t5": ("conversion", ["training=t5/220m", "conversion=t5/convert_t5"]),
    "conversion_bert": (
        "conversion",
        ["training=bert/tiny", "conversion=bert/convert_bert", "conversion.run.hf_dir_name=hf"],
    ),
    "evaluation_gpt3_tp2": (
        "evaluation",
        [
            "training=gpt3/126m",
            "evaluation.model.tensor_model_parallel_size=2",
            "evaluation.run.tasks=all_tasks",
        ],
    ),
    "export_gpt3": ("export", ["export.run.model_train_name=gpt3_126m"]),
    "export_t5": ("export", ["export=t5/export_t5"]),
    "sft_squad": ("data_preparation", ["data_preparation=sft/squad"]),
    "sft_dolly": ("data_preparation", ["data_preparation=sft/dolly"]),
    "sft_xquad": ("data_preparation", ["data_preparation=sft/xquad"]),
    "fine_tuning_gpt3_squad": ("fine_tuning", ["fine_tuning=gpt3/squad"]),
    "fine_tuning_mt5_xquad_pp2": (
        "fine_tuning",
        [
            "fine_tuning=mt5/xquad",
            "fine_tuning.trainer.devices=2",
            "fine_tuning.model.pipeline_model_parallel_size=2",
        ],
    ),
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
    "dpo_gpt3_tiny_pp2": (
        "dpo",
        ["dpo.trainer.devices=2", "dpo.model.pipeline_model_parallel_size=2"],
    ),
    "dpo_llama3_8b": ("dpo", ["dpo=llama3/8b"]),
    "grpo_gpt3_tiny_dp2": ("grpo", ["grpo.trainer.devices=2"]),
    "rlhf_ppo_gpt3_tiny": ("rlhf_ppo", []),
    "rlhf_ppo_gpt3_tiny_servers": ("rlhf_ppo", ["rlhf_ppo.model.rlhf.layout=servers"]),
    "fine_tuning_gpt3_tiny": ("fine_tuning", ["fine_tuning=gpt3/tiny"]),
    "rlhf_rm_gpt3_tiny_tp2": (
        "rlhf_rm",
        ["rlhf_rm.trainer.devices=2", "rlhf_rm.model.tensor_model_parallel_size=2"],
    ),
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
IMAGE = "nvcr.io/nvidia/nemo:24.05"


# Cases only some backends render: the rest refuse them in one line (tested beside the feature).
ONLY_ON = {"rlhf_ppo_gpt3_tiny_servers": ("bcm", "local")}


def case_backends(backends: Iterable[str]) -> list[tuple[str, str]]:
    """(case, backend) for every case of CASES and backend that renders it."""
    return [
        (case, backend)
        for case in sorted(CASES)
        for backend in sorted(backends)
        if backend in ONLY_ON.get(case, (backend,))
    ]


def case_overrides(
    case: str, backend_name: str, paths: list[str] = PATHS, k8s: list[str] = K8S
) -> tuple[str, list[str]]:
    """(stage, overrides) that compose a case of CASES for a backend, with `paths` for the
    three root paths and, for k8s, `k8s` for the volumes holding them."""
    stage, overrides = CASES[case]
    if backend_name != "bcm":
        overrides = [o for o in overrides if not o.startswith("++cluster.")]
    if backend_name == "local":  # runs this machine's Python, and refuses a container
        overrides = [o for o in overrides if not o.startswith(("container=", "container_mounts="))]
    extra = []
    if backend_name == "k8s":
        extra = list(k8s)
        if not any(o.startswith("container=") for o in overrides):
            extra.append(f"container={IMAGE}")
    return stage, [*paths, f"cluster_type={backend_name}", *extra, f"stages=[{stage}]", *overrides]


def assert_goldens(
    folder: Path, scripts: dict[str, str], backend_name: str, update: bool, scratch: Path
) -> None:
    """`scripts` (name -> text) are the files of `folder`, byte for byte (rewritten first with
    --update-goldens); each script passes `bash -n` and shellcheck, each manifest the pinned
    Kubernetes schemas."""
    if update:
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
            from tests.support.k8s_schema import validate_manifest

            validate_manifest(text)
            continue
        script = scratch / name
        script.write_text(text)
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        if shutil.which("shellcheck") or os.environ.get("CI") == "true":
            assert shutil.which("shellcheck"), "CI must install shellcheck (.ci/run does)"
            lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout
