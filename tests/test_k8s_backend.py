"""The Kubernetes backend: what its manifests say, that they are valid Kubernetes, and that their
wiring runs.

There is no Kubernetes cluster here. Manifests are checked offline against the official OpenAPI
schemas (kubernetes-validate, strict mode). The end-to-end tests put a stand-in `kubectl` on
PATH (tests/scripts/kubectl_shim.py): `apply` starts each pod's container command as a local process
with the pod's declared environment and Kubernetes' `$(VAR)` expansion, and reports the Job's
conditions from the processes' exit codes. They test our wiring (node ranks from the completion
index, torchrun's static rendezvous at pod 0, array ranks, quoting, log streaming, exit codes,
reruns), not Kubernetes: no API server, scheduling, images, volumes, GPUs or RDMA, and no
cluster DNS (the shim maps pod 0's `<job>-0.<service>` name to 127.0.0.1 when a Service of the
Job makes it resolvable). A last test replays every kubectl call the backend made against the
real kubectl client, so their flags are ones kubectl accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.clusters import BACKENDS, JobRecord
from launcher_scripts.clusters.base import time_limit_seconds
from launcher_scripts.clusters.k8s import (
    JobRef,
    K8sBackend,
    get_job,
    job_state,
    pod_exit_code,
    stuck_pods,
)
from launcher_scripts.clusters.k8s_manifest import k8s_name
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.jobspec import Command, JobSpec, Resources
from tests.support import REPO
from tests.support.commands import run_main
from tests.support.k8s_schema import PINNED_VERSION, validate_manifest

SHIM = Path(__file__).parent / "scripts" / "kubectl_shim.py"
CLUSTER = REPO / "conf" / "cluster" / "k8s.yaml"
IMAGE = "nvcr.io/nvidia/nemo:24.05"

PROGRAM = """
import os, sys
print(f"rank {os.environ.get('RANK', '-')} of {os.environ.get('WORLD_SIZE', '-')}"
      f" group {os.environ.get('GROUP_RANK', '-')}: {sys.argv[1:]}")
print(f"cwd {os.getcwd()} greeting {os.environ.get('GREETING', '-')}")
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""
# Runs until its argument names a file that exists.
WAITER = """
import pathlib, sys, time
while not pathlib.Path(sys.argv[1]).exists():
    time.sleep(0.05)
"""


def root_config(folder: Path, **cluster: Any) -> DictConfig:
    """A resolved root config for the k8s backend, with `folder` and this checkout mounted."""
    section = OmegaConf.to_container(OmegaConf.load(CLUSTER))
    section.update(
        volumes=[
            {"name": "code", "mount_path": str(REPO), "host_path": str(REPO)},
            {"name": "work", "mount_path": str(folder), "host_path": str(folder)},
        ],
        poll_seconds=0.1,
    )
    section.update(cluster)
    return OmegaConf.create(
        {
            "cluster": section,
            "container": IMAGE,
            "container_mounts": [],
            "launcher_scripts_path": str(REPO),
            "data_dir": str(folder / "data"),
            "base_results_dir": str(folder),
        }
    )


def job_in(folder: Path, *commands: Command, **fields: Any) -> JobSpec:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hello_job.py").write_text(PROGRAM)
    (folder / "waiter.py").write_text(WAITER)
    return JobSpec(
        stage="test",
        name=fields.pop("name", "hello"),
        results_dir=str(folder),
        commands=commands,
        pythonpath=f"{folder}:{REPO}",
        container=IMAGE,
        **fields,
    )


def objects(text: str) -> dict[str, dict[str, Any]]:
    """The manifest's objects by kind, each validated against the pinned schema."""
    return {obj["kind"]: obj for obj in validate_manifest(text)}


def container_of(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]["containers"][0]


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    return {
        entry["name"]: entry.get("value", entry.get("valueFrom"))
        for entry in container_of(job)["env"]
    }


# ----- the manifests: schema-valid, and what they say --------------------------------------------


def test_k8s_is_a_registered_synchronous_backend_writing_manifests() -> None:
    assert BACKENDS["k8s"] is K8sBackend and K8sBackend.synchronous
    assert K8sBackend.script_suffix == "_manifest.yaml"


def test_multi_node_training_job_is_valid_and_wired_for_torchrun(tmp_path: Path) -> None:
    root = root_config(
        tmp_path,
        namespace="llm",
        image_pull_secrets=["ngc-secret"],
        rdma_resources={"rdma/ib": 1},
        volumes=[
            {"name": "code", "mount_path": str(REPO), "host_path": str(REPO)},
            {"name": "data", "mount_path": str(tmp_path / "data"), "pvc": "launcher-data"},
            {
                "name": "results",
                "mount_path": str(tmp_path),
                "nfs": {"server": "nfs.example.com", "path": "/export/results"},
                "read_only": False,
            },
        ],
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        env={"NCCL_IB_HCA": "mlx5"},
        labels={"team": "llm"},
        annotations={"example.com/queue": "training"},
    )
    job = job_in(
        tmp_path,
        Command("launcher_scripts.jobs.training.pretrain", ("--config", "c.yaml"), 8),
        name="gpt3_5b",
        resources=Resources(nodes=2, ntasks_per_node=8, gpus_per_node=8, time_limit="1-00:00:00"),
        env=(("GREETING", "hi"),),
        checkpoint_exit_code=75,
    )
    found = objects(K8sBackend(root).render(job))
    service, manifest = found["Service"], found["Job"]
    assert list(found) == ["Service", "Job"]  # the Service first: pod names resolve at start
    assert service["metadata"] == {
        "name": "gpt3-5b",
        "namespace": "llm",
        "labels": {
            "app.kubernetes.io/managed-by": "llm-launcher",
            "llm-launcher/stage": "test",
            "team": "llm",
        },
    }
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "gpt3-5b"}
    spec = manifest["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 86400
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "gpt3-5b" and pod["restartPolicy"] == "Never"
    assert pod["imagePullSecrets"] == [{"name": "ngc-secret"}]
    assert pod["terminationGracePeriodSeconds"] == 120
    container = container_of(manifest)
    assert container["image"] == IMAGE and container["workingDir"] == str(tmp_path)
    assert container["command"] == [
        "python3", "-u", "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=$(NODE_RANK)",
        "--nproc-per-node=8", "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)",
        "-m", "launcher_scripts.jobs.training.pretrain", "--config", "c.yaml",
    ]  # fmt: skip
    env = env_of(manifest)
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": index}}
    assert env["MASTER_ADDR"] == "gpt3-5b-0.gpt3-5b" and env["MASTER_PORT"] == "29500"
    assert env["GREETING"] == "hi" and env["NCCL_IB_HCA"] == "mlx5"
    assert env["PYTHONPATH"] == f"{tmp_path}:{REPO}"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8", "rdma/ib": "1"}}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "launcher-data"}
    assert volumes["results"]["nfs"] == {"server": "nfs.example.com", "path": "/export/results"}
    assert volumes["code"]["hostPath"]["path"] == str(REPO)
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["data"] == str(tmp_path / "data")


def test_array_data_prep_job_gives_each_pod_one_rank(tmp_path: Path) -> None:
    job = job_in(
        tmp_path,
        Command("launcher_scripts.jobs.data_prep.preprocess", ("--input", "/data/a.jsonl")),
        name="custom_dataset-preprocess",
        resources=Resources(cpus_per_task=16),
        array_size=4,
    )
    found = objects(K8sBackend(root_config(tmp_path, rdma_resources={"rdma/ib": 1})).render(job))
    assert list(found) == ["Job"]  # no Service: the tasks do not talk to each other
    manifest = found["Job"]
    assert manifest["metadata"]["name"] == "custom-dataset-preprocess"
    assert (manifest["spec"]["completions"], manifest["spec"]["parallelism"]) == (4, 4)
    env = env_of(manifest)
    assert env["RANK"]["fieldRef"]["fieldPath"].endswith(
        "['batch.kubernetes.io/job-completion-index']"
    )
    assert env["WORLD_SIZE"] == "4" and "NODE_RANK" not in env
    container = container_of(manifest)
    assert container["command"][:4] == [
        "python3",
        "-u",
        "-m",
        "launcher_scripts.jobs.data_prep.preprocess",
    ]
    # A CPU job asks for no GPU or RDMA device, nor for its Slurm-sized cpus_per_node.
    assert "resources" not in container
    assert "subdomain" not in manifest["spec"]["template"]["spec"]


def test_cpu_job_of_several_commands_runs_them_in_order_through_sh(tmp_path: Path) -> None:
    job = job_in(
        tmp_path,
        Command("hello_job", ("it's", "$HOME", "$(NODE_RANK)")),
        Command("hello_job", ("second",), nproc_per_node=2),
    )
    root = root_config(tmp_path, shm_size=None, ttl_seconds_after_finished=None, cpu_request="4")
    manifest = objects(K8sBackend(root).render(job))["Job"]
    command = container_of(manifest)["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    # Literal `$` from the configuration is escaped ($$) so Kubernetes expands nothing of it.
    assert command[2].splitlines() == [
        "set -e",
        "python3 -u -m hello_job 'it'\"'\"'s' '$$HOME' '$$(NODE_RANK)'",
        # The last program replaces sh (PID 1), so it gets the SIGTERM of a deleted pod.
        "exec python3 -u -m torch.distributed.run --standalone --nproc-per-node=2 -m hello_job "
        "second",
    ]
    assert container_of(manifest)["resources"] == {"requests": {"cpu": "4"}}
    assert "ttlSecondsAfterFinished" not in manifest["spec"]
    assert all(v["name"] != "dshm" for v in manifest["spec"]["template"]["spec"]["volumes"])


def test_a_broken_manifest_fails_the_schema_check(tmp_path: Path) -> None:
    """The check can fail: a misspelt field and a wrong type are both refused."""
    text = K8sBackend(root_config(tmp_path)).render(job_in(tmp_path, Command("hello_job")))
    validate_manifest(text)
    with pytest.raises(kubernetes_validate.ValidationError, match="completionMod"):
        validate_manifest(text.replace("completionMode:", "completionMod:"))
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(text.replace("parallelism: 1", "parallelism: one"))


def test_rendering_is_deterministic_and_yaml_round_trips(tmp_path: Path) -> None:
    job = job_in(tmp_path, Command("hello_job", ("x",), 2), resources=Resources(nodes=3))
    first = K8sBackend(root_config(tmp_path)).render(job)
    assert first == K8sBackend(root_config(tmp_path)).render(job)
    assert first.startswith("# Stage test, job hello: rendered by launcher_scripts")
    assert len(list(yaml.safe_load_all(first))) == 2


def test_names_are_dns_labels_stable_and_distinct() -> None:
    assert k8s_name("custom_dataset-preprocess") == "custom-dataset-preprocess"
    assert k8s_name("126M__Model") == "j-126m-model"  # Service names start with a letter
    long_a, long_b = "a" * 80, "a" * 79 + "b"
    assert len(k8s_name(long_a)) == 56 and k8s_name(long_a) == k8s_name(long_a)
    assert k8s_name(long_a) != k8s_name(long_b)
    assert k8s_name(long_a).startswith("a" * 47 + "-")


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [("30", 1800), ("0:30:00", 1800), ("4:00:00", 14400), ("1-00:00:00", 86400), ("2-3", 183600)],
)
def test_slurm_time_limits_become_the_jobs_deadline(limit: str, seconds: int) -> None:
    assert time_limit_seconds(limit, "training.run.time_limit") == seconds


def test_bad_time_limit_names_its_key() -> None:
    with pytest.raises(ConfigError, match=r"^training.run.time_limit: 'soon' is not a time limit"):
        time_limit_seconds("soon", "training.run.time_limit")


# ----- preflight: one line naming the key -------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"container": None}, "container: is not set but the k8s backend runs every job"),
        (
            {"cluster.volumes": [{"name": "x", "mount_path": "/x", "pvc": "a", "host_path": "/x"}]},
            "cluster.volumes[0]: volume x needs exactly one source but has pvc, host_path",
        ),
        (
            {"cluster.volumes": [{"name": "x", "mount_path": "/x"}]},
            "cluster.volumes[0]: volume x needs exactly one source but has none",
        ),
        (
            {"cluster.volumes": [{"name": "Bad_Name", "mount_path": "/x", "pvc": "a"}]},
            "cluster.volumes[0].name: 'Bad_Name' is not a valid Kubernetes name",
        ),
        (
            {"cluster.volumes": [{"name": "x", "mount_path": "/x", "nfs": {"server": "s"}}]},
            "cluster.volumes[0].nfs: needs a server and a path",
        ),
        ({"cluster.k8s_version": "1.24"}, "cluster.k8s_version: '1.24' is not a Kubernetes"),
        ({"cluster.namespace": "My NS"}, "cluster.namespace: 'My NS' is not a valid Kubernetes"),
    ],
)
def test_preflight_names_the_key(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    root = root_config(tmp_path)
    for key, value in change.items():
        OmegaConf.update(root, key, value, merge=False)
    with pytest.raises(ConfigError) as error:
        K8sBackend(root)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_preflight_refuses_paths_the_pods_cannot_see(tmp_path: Path) -> None:
    root = root_config(tmp_path)
    root.cluster.volumes = [{"name": "code", "mount_path": str(REPO), "pvc": "code"}]
    with pytest.raises(ConfigError) as error:
        K8sBackend(root)
    assert str(error.value) == (
        f"data_dir: {tmp_path}/data is on no volume of the pods, so they could not see the data "
        f"(volumes: code at {REPO}). Add a cluster.volumes entry whose mount_path holds it, e.g. "
        f"{{name: work, mount_path: {tmp_path}/data, pvc: <claim>}}, or change data_dir"
    )
    # container_mounts are host paths bound into the container, as with pyxis: they count.
    root.container_mounts = [f"/srv/shared:{tmp_path}"]
    text = K8sBackend(root).render(job_in(tmp_path, Command("hello_job")))
    volumes = objects(text)["Job"]["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "mount-1",
        "hostPath": {"path": "/srv/shared", "type": "DirectoryOrCreate"},
    } in volumes


def test_preflight_wants_the_k8s_cluster_section(tmp_path: Path) -> None:
    root = root_config(tmp_path)
    root.cluster = OmegaConf.load(REPO / "conf" / "cluster" / "bcm.yaml")
    with pytest.raises(
        ConfigError, match="^cluster: is not the Kubernetes cluster section.*Add cluster=k8s"
    ):
        K8sBackend(root)


def test_more_gpus_than_a_node_has_is_refused(tmp_path: Path) -> None:
    job = job_in(tmp_path, Command("hello_job", (), 16), resources=Resources(gpus_per_node=16))
    with pytest.raises(ConfigError, match="16 GPUs on each node but cluster.gpus_per_node is 8"):
        K8sBackend(root_config(tmp_path)).render(job)


def test_invalid_pass_through_settings_fail_the_schema_check_at_render(tmp_path: Path) -> None:
    root = root_config(tmp_path, tolerations=[{"key": "a", "operatorr": "Exists"}])
    with pytest.raises(ConfigError, match="operatorr"):
        K8sBackend(root).render(job_in(tmp_path, Command("hello_job")))


def test_check_submission_needs_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(
        ConfigError, match="^cluster_type: is k8s but kubectl is not on PATH.*dry_run=true"
    ):
        K8sBackend(root_config(tmp_path)).check_submission([])


def test_dry_run_renders_a_training_manifest(tmp_path: Path) -> None:
    volumes = (
        f"cluster.volumes=[{{name:code,mount_path:{REPO},host_path:{REPO}}},"
        f"{{name:work,mount_path:{tmp_path},pvc:work}}]"
    )
    common = (
        "stages=[data_preparation,training]",
        "cluster=k8s",
        "cluster_type=k8s",
        "dry_run=true",
        f"base_results_dir={tmp_path}/results",
        f"data_dir={tmp_path}/data",
    )
    refused = run_main(*common, volumes)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: container: is not set but the k8s backend runs every job in a container image. "
        "Set container=<image>, e.g. container=nvcr.io/nvidia/nemo:24.05"
    ]
    result = run_main(*common, volumes, f"container={IMAGE}", "training.trainer.num_nodes=2")
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = tmp_path / "results" / "gpt3_tiny" / "gpt3_tiny_manifest.yaml"
    assert f"job gpt3_tiny (k8s): {manifest}" in result.stdout
    found = objects(manifest.read_text())
    assert found["Job"]["spec"]["completions"] == 2 and "Service" in found
    assert "--node-rank=$(NODE_RANK)" in container_of(found["Job"])["command"]


# ----- the wiring, run with the kubectl stand-in ---------------------------------------------


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in kubectl on PATH; yields its state folder (calls.jsonl: every call)."""
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    kubectl = shim_dir / "kubectl"
    kubectl.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(SHIM))} "$@"\n'
    )
    kubectl.chmod(0o755)
    state = tmp_path / "kube"
    # `python3` in the pods' commands is this interpreter, as in a container built for the job.
    path = os.pathsep.join([str(shim_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("KUBECTL_SHIM_STATE", str(state))
    monkeypatch.setenv("KUBECTL_SHIM_K8S_VERSION", PINNED_VERSION)
    yield state
    for pid in state.glob("jobs/*/*/kubelet.pid"):  # a test that failed half-way
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid.read_text()), signal.SIGKILL)


def run_job(job: JobSpec, root: DictConfig | None = None) -> tuple[JobRecord, str]:
    backend = K8sBackend(root if root is not None else root_config(Path(job.results_dir)))
    script = Path(job.results_dir) / f"{job.name}_manifest.yaml"
    script.write_text(backend.render(job))
    record = JobRecord(job.name, job.stage, "k8s", str(script), backend.log_path(job, "run1"))
    backend.submit(str(script), job, record, [], lambda r: None)
    return record, Path(record.log).read_text()


def wait_for_end(ref: JobRef) -> None:
    """Until the Job has its Complete or Failed condition."""
    while job_state(get_job(ref) or {}) not in ("COMPLETED", "FAILED"):
        time.sleep(0.05)


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def test_two_nodes_meet_at_pod_0_and_ranks_follow_pod_indexes(tmp_path: Path, kube: Path) -> None:
    job = job_in(
        tmp_path, Command("hello_job", ("z",), nproc_per_node=2), resources=Resources(nodes=2)
    )
    record, log = run_job(job)
    assert record.state == "COMPLETED" and record.exit_code == 0, log
    assert record.job_ids == ["default/hello"]
    for rank in range(4):
        pod = rank // 2  # static rendezvous: node rank = completion index
        assert f"[pod/hello-{pod}-shim/main] rank {rank} of 4 group {pod}: ['z']" in log, log
    assert "service/hello created" in log and "job.batch/hello created" in log
    # The pods' logs were followed as they ran (torchrun takes longer to start than one poll).
    assert any(call[0] == "logs" and "--follow" in call for call in calls(kube))
    # The Service goes once the Job has ended; the Job stays until its TTL.
    assert not (kube / "services" / "default" / "hello.json").exists()
    assert (kube / "jobs" / "default" / "hello").exists()


def test_array_job_pods_take_their_rank_from_the_index(tmp_path: Path, kube: Path) -> None:
    record, log = run_job(job_in(tmp_path, Command("hello_job", ("y",)), array_size=3))
    assert record.state == "COMPLETED", log
    for index in range(3):
        assert f"[pod/hello-{index}-shim/main] rank {index} of 3 group -: ['y']" in log, log


def test_arguments_and_environment_reach_the_program_literally(tmp_path: Path, kube: Path) -> None:
    folder = tmp_path / "it's a dir"
    job = job_in(
        folder,
        Command("hello_job", ("a b", "it's", "$HOME", "$(NODE_RANK)", "$$")),
        env=(("GREETING", "hi $(USER) 'you'"),),
    )
    record, log = run_job(job, root_config(tmp_path))
    assert record.state == "COMPLETED", log
    assert "rank - of - group -: ['a b', \"it's\", '$HOME', '$(NODE_RANK)', '$$']" in log
    assert f"cwd {folder} greeting hi $(USER) 'you'" in log


def test_a_failing_command_fails_the_job_with_its_exit_code(tmp_path: Path, kube: Path) -> None:
    job = job_in(
        tmp_path,
        Command("hello_job", ("first",)),
        Command("hello_job", ("second",)),
        env=(("EXIT_WITH", "3"),),
    )
    record, log = run_job(job)
    # The program's own code: one process runs without torchrun (which would exit with 1).
    assert record.state == "FAILED" and record.exit_code == 3, log
    assert "['first']" in log and "['second']" not in log
    assert "launcher: Job default/hello failed: BackoffLimitExceeded" in log


def test_a_rerun_replaces_the_finished_job_but_never_a_running_one(
    tmp_path: Path, kube: Path
) -> None:
    job = job_in(tmp_path, Command("hello_job", ("again",)))
    run_job(job)
    record, log = run_job(job)
    assert record.state == "COMPLETED", log
    assert "launcher: deleting the finished Job default/hello of an earlier run" in log
    assert log.count("['again']") == 2  # the log file is appended to; one run each

    release = tmp_path / "release"
    waiting = job_in(tmp_path, Command("waiter", (str(release),)), name="waiting")
    manifest = tmp_path / "waiting_manifest.yaml"
    manifest.write_text(K8sBackend(root_config(tmp_path)).render(waiting))
    subprocess.run(["kubectl", "apply", "-f", str(manifest)], check=True, capture_output=True)
    with pytest.raises(LauncherError, match="Job waiting is already running in namespace default"):
        run_job(waiting)
    release.touch()
    wait_for_end(JobRef("default", "waiting"))
    record, log = run_job(waiting)  # once it has ended, the rerun goes ahead
    assert record.state == "COMPLETED", log


# Saves its "checkpoint" and exits 75 on SIGTERM, as the training program does.
STOPPER = """
import pathlib, signal, sys, time
def stop(signum, frame):
    pathlib.Path(sys.argv[1]).write_text(f"stopped by {signal.Signals(signum).name}")
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1] + ".ready").touch()
while True:
    time.sleep(0.05)
"""


def test_cancel_gives_the_program_sigterm_and_the_clusters_grace(
    tmp_path: Path, kube: Path
) -> None:
    """A deleted pod's process 1 gets SIGTERM and terminationGracePeriodSeconds: the program,
    not a shell in front of it (sh as PID 1 ignores SIGTERM), with signal_grace_seconds, the
    key every backend reads, as the pod's grace and torchrun's."""
    saved = tmp_path / "saved"
    job = job_in(
        tmp_path,
        Command("hello_job", ("first",)),
        Command("stopper", (str(saved),)),
        checkpoint_exit_code=75,
    )
    (tmp_path / "stopper.py").write_text(STOPPER)
    backend = K8sBackend(root_config(tmp_path, signal_grace_seconds=345))
    manifest = tmp_path / "hello_manifest.yaml"
    manifest.write_text(backend.render(job))
    job_object = objects(manifest.read_text())["Job"]
    assert job_object["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 345
    assert env_of(job_object)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "345"
    subprocess.run(["kubectl", "apply", "-f", str(manifest)], check=True, capture_output=True)
    deadline = time.monotonic() + 300
    while not Path(f"{saved}.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    record = JobRecord("hello", "test", "k8s", str(manifest), str(tmp_path / "log"))
    record.job_ids, record.state = ["default/hello"], "RUNNING"
    assert K8sBackend().cancel(record) is None  # Kubernetes enforces the grace itself
    assert saved.read_text() == "stopped by SIGTERM"


def test_status_and_cancel_ask_kubectl(tmp_path: Path, kube: Path) -> None:
    release = tmp_path / "release"
    job = job_in(tmp_path, Command("waiter", (str(release),)), resources=Resources(nodes=2))
    manifest = tmp_path / "hello_manifest.yaml"
    manifest.write_text(K8sBackend(root_config(tmp_path)).render(job))
    subprocess.run(["kubectl", "apply", "-f", str(manifest)], check=True, capture_output=True)
    record = JobRecord("hello", "test", "k8s", str(manifest), str(tmp_path / "log"))
    record.job_ids, record.state = ["default/hello"], "RUNNING"
    backend = K8sBackend()  # as `status` and `cancel` make it: without a configuration
    backend.refresh(record)
    assert record.state in ("PENDING", "RUNNING")
    backend.cancel(record)
    assert [
        "delete",
        "job/hello",
        "service/hello",
        "--namespace=default",
        "--ignore-not-found",
    ] in calls(kube)
    backend.refresh(record)
    assert record.state == "LOST"
    record.state = "COMPLETED"  # a finished record stays as it is, whatever the TTL removed
    backend.refresh(record)
    assert record.state == "COMPLETED"


def test_a_few_failed_api_calls_are_ridden_out(
    tmp_path: Path, kube: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECTL_SHIM_FAILED_GETS", "3")
    record, log = run_job(job_in(tmp_path, Command("hello_job", ("on",))))
    assert record.state == "COMPLETED", log
    assert log.count("The connection to the server was refused; trying again") == 3


def test_an_unreachable_api_server_ends_the_wait(
    tmp_path: Path, kube: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECTL_SHIM_FAILED_GETS", "1000")
    with pytest.raises(LauncherError, match="could not reach the API server 11 times in a row"):
        run_job(job_in(tmp_path, Command("hello_job")))


def test_exit_codes_and_stuck_pods_are_read_from_pod_status() -> None:
    def pod(index: int, state: dict[str, Any], **status: Any) -> dict[str, Any]:
        annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
        return {
            "metadata": {"name": f"p{index}", "annotations": annotations},
            "status": {"containerStatuses": [{"name": "main", "state": state}], **status},
        }

    ended = [pod(1, {"terminated": {"exitCode": 143}}), pod(0, {"terminated": {"exitCode": 2}})]
    assert pod_exit_code(ended) == 2  # the lowest index first
    assert pod_exit_code([pod(0, {"terminated": {"exitCode": 0}})]) == 0
    assert pod_exit_code([pod(0, {"running": {}})]) is None
    pulling = pod(0, {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}})
    pending = pod(
        1,
        {"waiting": {"reason": "ContainerCreating"}},
        conditions=[
            {"type": "PodScheduled", "reason": "Unschedulable", "message": "0/4 nodes: gpu"}
        ],
    )
    assert stuck_pods([pulling, pending]) == [
        "pod p0: ImagePullBackOff: no such image",
        "pod p1: Unschedulable: 0/4 nodes: gpu",
    ]


def test_pipeline_with_kubectl_shim_stops_at_a_failing_job(tmp_path: Path, kube: Path) -> None:
    results, data = tmp_path / "results", tmp_path / "data"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json\n{"no_text": 1}\n' * 10)
    sample = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    result = run_main(
        "cluster=k8s",
        "cluster_type=k8s",
        f"container={IMAGE}",
        f"cluster.volumes=[{{name:code,mount_path:{REPO},host_path:{REPO}}},"
        f"{{name:work,mount_path:{tmp_path},host_path:{tmp_path}}}]",
        "cluster.poll_seconds=0.1",
        f"base_results_dir={results}",
        f"data_dir={data}",
        "stages=[data_preparation]",
        f"data_preparation.raw_dataset_files=[{broken}]",
        f"data_preparation.train_tokenizer_args.input={sample}",
        "data_preparation.train_tokenizer_args.vocab_size=500",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert "custom_dataset-preprocess failed with exit code 1" in error
    log = next((results / "custom_dataset").glob("log-custom_dataset-preprocess_*.out"))
    assert str(log) in error and "broken.jsonl:2" in log.read_text()
    manifests = sorted(p.name for p in (results / "custom_dataset").glob("*_manifest.yaml"))
    assert manifests == [
        "custom_dataset-preprocess_manifest.yaml",
        "custom_dataset-train_tokenizer_manifest.yaml",
    ]
    applied = [call for call in calls(kube) if call[0] == "apply"]
    assert len(applied) == 2  # the tokenizer, then the preprocessing that failed


def test_every_kubectl_call_is_one_the_real_kubectl_accepts(tmp_path: Path, kube: Path) -> None:
    """Each call the backend made, replayed with the real client against an unreachable API
    server: kubectl must get as far as connecting, so its verbs and flags all parse."""
    shim_dir = str(tmp_path / "shim")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != shim_dir)
    real = shutil.which("kubectl", path=path)
    if real is None:
        message = "the real kubectl is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}: CI must install it")
        pytest.skip(message)
    run_job(job_in(tmp_path, Command("hello_job"), resources=Resources(nodes=2)))
    failing = job_in(tmp_path, Command("hello_job"), env=(("EXIT_WITH", "1"),), name="x")
    run_job(failing)
    record, _ = run_job(failing)  # a rerun deletes the Job the first run left
    K8sBackend().cancel(record)
    K8sBackend().refresh(record)
    made = calls(kube)
    verbs = {tuple(call[:2]) for call in made}
    assert {("apply", "-f"), ("get", "job"), ("get", "pods"), ("delete", "job/x")} <= verbs
    assert any(call[0] == "logs" for call in made)
    offline = {**os.environ, "KUBECONFIG": os.devnull}
    for call in sorted(set(map(tuple, made))):  # each poll repeats the same two calls
        result = subprocess.run(
            [real, *call, "--server=http://127.0.0.1:1"],
            capture_output=True,
            text=True,
            env=offline,
        )
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "127.0.0.1:1" in output, (call, output)
        for refusal in ("unknown flag", "unknown shorthand", "invalid argument", "unknown command"):
            assert refusal not in output, (call, output)
