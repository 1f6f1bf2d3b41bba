"""Kubernetes manifests for JobSpecs: an Indexed batch/v1 Job, and a headless Service for the
pods of a multi-node job to find each other. Pure: the same JobSpec and settings give the same
bytes.

Why an Indexed Job. It is core API (GA since Kubernetes 1.24): nothing to install on the
cluster, unlike a Kubeflow PyTorchJob (the training operator) or a JobSet (its controller), and
the manifests validate offline against the official OpenAPI schemas. `completionMode: Indexed`
with completions = parallelism = the job's nodes (or its array tasks) gives every pod an index,
0..N-1, which becomes the node rank (or the array task's rank). For a multi-node job a headless
Service (clusterIP: None) named like the Job is the pods' `subdomain`, so pod i answers at
`<job>-<i>.<job>`; `publishNotReadyAddresses` publishes each pod's record as soon as it has an
address, without waiting for readiness.

Rendezvous. torchrun's static rendezvous: every pod runs `torchrun --nnodes=N
--node-rank=$(NODE_RANK) --master-addr=$(MASTER_ADDR) --master-port=$(MASTER_PORT)`, with
NODE_RANK taken from the pod's completion-index annotation (a fieldRef, so no shell is needed:
Kubernetes expands `$(VAR)` of declared variables in a container's command) and MASTER_ADDR
naming pod 0. Chosen over c10d because pod 0 then hosts the store because its index is 0; c10d
decides who hosts by matching the endpoint's DNS name to the pod's own addresses, which fails
when pod 0's record is not yet published as it starts; the other pods simply retry connecting
until it is. Global ranks also follow pod indexes, so a rank's log line names its pod.

Array jobs (data preparation): each pod is one task, given RANK = its index and WORLD_SIZE = the
array size, the pair launcher_scripts.formats.shards reads. Single-node jobs run
`torchrun --standalone` (several processes) or plain `python3 -u -m module` (one). A job of
several commands runs them in order in one container through `sh -c`, each line an argv joined
by shlex.join.

Every literal `$` from the configuration (arguments, environment values) is doubled, Kubernetes'
escape, so only the backend's own `$(NODE_RANK)`-style references are expanded.

Names. Kubernetes names must be DNS labels; a Job's name also starts its pods' hostnames
(`<job>-<index>`, at most 63 characters). Names derive from JobSpec.name: lowercase, characters
other than [a-z0-9-] become '-', a leading digit gets a "j-" prefix (Service names must start
with a letter), and a name longer than 56 characters is cut and given an 8-character hash of the
full name, so it stays stable and distinct.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from typing import Any

import yaml

from launcher_scripts.clusters.base import check_gpus_per_node, shutdown_env, time_limit_seconds
from launcher_scripts.clusters.k8s_settings import SHM_VOLUME, K8sSettings
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.jobspec import Command, JobSpec

# torchrun's default master port; each job has pods of its own, so no two jobs share it.
RENDEZVOUS_PORT = 29500
CONTAINER = "main"
MAX_NAME = 56  # leaves room for "-<index>" in the 63 characters of a pod's hostname
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set on each pod by the Job controller
MANAGED_BY = ("app.kubernetes.io/managed-by", "llm-launcher")


def k8s_name(name: str) -> str:
    """A DNS-1035 label for the Job, Service and pod hostnames of JobSpec `name`."""
    label = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-") or "job"
    if not label[0].isalpha():
        label = f"j-{label}"
    if len(label) <= MAX_NAME:
        return label
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{label[: MAX_NAME - 9].rstrip('-')}-{digest}"


def literal(text: str) -> str:
    """`text` with Kubernetes' `$(VAR)` expansion escaped: each `$` doubled."""
    return text.replace("$", "$$")


def pod_count(job: JobSpec) -> int:
    return job.array_size if job.array_size is not None else job.resources.nodes


def is_multi_node(job: JobSpec) -> bool:
    """Whether the pods of this job talk to each other (and so need the Service)."""
    return job.array_size is None and job.resources.nodes > 1


def program_argv(job: JobSpec, command: Command) -> list[str]:
    """What the container runs for one command; `$(VAR)` references are the only unescaped
    `$` in it."""
    program = ["-m", literal(command.module), *map(literal, command.args)]
    if job.array_size is not None and command.nproc_per_node > 1:
        raise LauncherError(
            f"job {job.name} is an array whose tasks have {command.nproc_per_node} processes; "
            "array tasks are one process each (a bug in its stage: please report it)"
        )
    torchrun = ["python3", "-u", "-m", "torch.distributed.run"]
    if is_multi_node(job):
        return [
            *torchrun,
            f"--nnodes={job.resources.nodes}",
            "--node-rank=$(NODE_RANK)",
            f"--nproc-per-node={command.nproc_per_node}",
            "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)",
            *program,
        ]
    if command.nproc_per_node > 1:
        return [*torchrun, "--standalone", f"--nproc-per-node={command.nproc_per_node}", *program]
    return ["python3", "-u", *program]


def container_command(job: JobSpec) -> list[str]:
    argvs = [program_argv(job, command) for command in job.commands]
    if len(argvs) == 1:
        return argvs[0]
    # Kubernetes expands $(VAR) in the script before sh reads it; shlex quoting keeps every
    # argument one word and literal. The last program replaces sh, so it gets the SIGTERM of a
    # deleted pod (sh as PID 1 would ignore it).
    lines = [shlex.join(argv) for argv in argvs]
    script = "\n".join(["set -e", *lines[:-1], f"exec {lines[-1]}"])
    return ["/bin/sh", "-c", script]


def _env(job: JobSpec, settings: K8sSettings, name: str) -> list[dict[str, Any]]:
    index = {"valueFrom": {"fieldRef": {"fieldPath": INDEX_FIELD}}}
    env: list[dict[str, Any]] = []
    if is_multi_node(job):
        env += [
            {"name": "NODE_RANK", **index},
            {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        ]
    elif job.array_size is not None:
        env += [
            {"name": "RANK", **index},
            {"name": "WORLD_SIZE", "value": str(job.array_size)},
        ]
    # Image variables cannot be extended ($(PYTHONPATH) names only declared ones): set it.
    env.append({"name": "PYTHONPATH", "value": literal(job.pythonpath)})
    # torchrun gives its ranks the grace the pod has, not its own 30 s.
    merged = dict(job.env) | dict(shutdown_env(job, settings.signal_grace_seconds))
    merged |= dict(settings.env)  # the cluster's extras win
    env += [{"name": key, "value": literal(value)} for key, value in sorted(merged.items())]
    return env


def _resources(job: JobSpec, settings: K8sSettings) -> dict[str, Any]:
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    gpus = job.resources.gpus_per_node
    if gpus:
        check_gpus_per_node([job], settings.gpus_per_node, "cluster.gpus_per_node")
        limits[settings.gpu_resource] = str(gpus)
        # Only GPU pods talk over the fabric; CPU pods (data preparation) need no RDMA device.
        limits.update((name, str(count)) for name, count in settings.rdma_resources)
    # Not the job's cpus_per_node: recipes size it for Slurm nodes (256 for data preparation),
    # which would leave a pod unschedulable on most Kubernetes nodes.
    if settings.cpu_request is not None:
        requests["cpu"] = settings.cpu_request
    if settings.memory_request is not None:
        requests["memory"] = settings.memory_request
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    return resources


def _volumes(settings: K8sSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts of them."""
    volumes, mounts = [], []
    for volume in settings.volumes:
        volumes.append({"name": volume.name, **volume.source})
        mount: dict[str, Any] = {"name": volume.name, "mountPath": volume.mount_path}
        if volume.read_only:
            mount["readOnly"] = True
        mounts.append(mount)
    if settings.shm_size:
        volumes.append(
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}
        )
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return volumes, mounts


def _metadata(
    name: str, settings: K8sSettings, job: JobSpec, annotations: bool = True
) -> dict[str, Any]:
    labels = dict([MANAGED_BY, ("llm-launcher/stage", k8s_name(job.stage))]) | dict(settings.labels)
    metadata: dict[str, Any] = {"name": name, "namespace": settings.namespace, "labels": labels}
    if annotations and settings.annotations:
        metadata["annotations"] = dict(settings.annotations)
    return metadata


def service_manifest(job: JobSpec, settings: K8sSettings) -> dict[str, Any]:
    name = k8s_name(job.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, settings, job, annotations=False),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_NAME_LABEL: name},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}
            ],
        },
    }


def job_manifest(job: JobSpec, settings: K8sSettings) -> dict[str, Any]:
    if not job.container:
        raise ConfigError("container", "is not set", "Set container=<image>")
    name = k8s_name(job.name)
    volumes, mounts = _volumes(settings)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.container,
        "command": container_command(job),
        "workingDir": job.results_dir,
        "env": _env(job, settings, name),
    }
    resources = _resources(job, settings)
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = mounts
    pod: dict[str, Any] = {"restartPolicy": "Never"}
    if is_multi_node(job):
        pod["subdomain"] = name
    if settings.service_account:
        pod["serviceAccountName"] = settings.service_account
    if settings.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in settings.image_pull_secrets]
    if settings.node_selector:
        pod["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod["tolerations"] = [dict(toleration) for toleration in settings.tolerations]
    if job.checkpoint_exit_code is not None:
        # Deleted (`launcher_scripts cancel`), evicted or past its deadline, the program (the
        # container's PID 1) gets SIGTERM and this long to save a checkpoint before SIGKILL.
        pod["terminationGracePeriodSeconds"] = settings.signal_grace_seconds
    pod["containers"] = [container]
    pod["volumes"] = volumes
    template_metadata = _metadata(name, settings, job)
    del template_metadata["name"], template_metadata["namespace"]
    pods = pod_count(job)
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": pods,
        "parallelism": pods,
        "backoffLimit": settings.backoff_limit,
        # From the Job's start, so it bounds time spent pending (unschedulable, image pulls).
        "activeDeadlineSeconds": time_limit_seconds(
            job.resources.time_limit, f"{job.stage}.run.time_limit"
        ),
    }
    if settings.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = settings.ttl_seconds_after_finished
    spec["template"] = {"metadata": template_metadata, "spec": pod}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, settings, job),
        "spec": spec,
    }


def manifests(job: JobSpec, settings: K8sSettings) -> list[dict[str, Any]]:
    """The objects to apply, in order: the Service first, so pod names resolve at start."""
    objects = [service_manifest(job, settings)] if is_multi_node(job) else []
    return [*objects, job_manifest(job, settings)]


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (a job's shell script), so people can read them."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


def render_manifest(job: JobSpec, settings: K8sSettings) -> str:
    header = [
        f"# Stage {job.stage}, job {job.name}: rendered by launcher_scripts (Kubernetes backend).",
        "# Submit it by hand with: kubectl apply -f <this file>",
    ]
    documents = [
        yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
        for obj in manifests(job, settings)
    ]
    return "\n".join(header) + "\n---\n" + "---\n".join(documents)
