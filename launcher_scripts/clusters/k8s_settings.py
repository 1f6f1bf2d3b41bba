"""The Kubernetes cluster section (conf/cluster/k8s.yaml), checked and typed.

Every problem is a ConfigError naming the key, found when the backend is made: before any file
is written, in dry runs too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from launcher_scripts.clusters.base import signal_grace_seconds
from launcher_scripts.config.checks import require_int
from launcher_scripts.errors import ConfigError

# A DNS-1123 label: what Kubernetes accepts as a namespace, volume or container name.
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The memory-backed /dev/shm volume the backend adds itself.
SHM_VOLUME = "dshm"
VOLUME_SOURCES = ("pvc", "nfs", "host_path")
# The pods' label `batch.kubernetes.io/job-name`, which the Services select on, is set by the
# Job controller from Kubernetes 1.27.
MIN_K8S_VERSION = (1, 27)
# Paths every pod must see, and what it would miss without them.
VISIBLE_PATHS = (
    ("launcher_scripts_path", "the code"),
    ("data_dir", "the data"),
    ("base_results_dir", "the results and the configs the jobs read"),
)


@dataclass(frozen=True)
class Volume:
    """A pod volume and where the container mounts it."""

    name: str
    mount_path: str
    source: dict[str, Any]  # one Kubernetes volume source, e.g. {"nfs": {...}}
    key: str  # where the configuration declares it, for error messages
    read_only: bool = False


@dataclass(frozen=True)
class K8sSettings:
    namespace: str
    image_pull_secrets: tuple[str, ...]
    service_account: str | None
    gpus_per_node: int | None
    gpu_resource: str
    rdma_resources: tuple[tuple[str, int], ...]
    shm_size: str | None
    cpu_request: str | None
    memory_request: str | None
    volumes: tuple[Volume, ...]
    node_selector: tuple[tuple[str, str], ...]
    tolerations: tuple[Mapping[str, Any], ...]
    env: tuple[tuple[str, str], ...]
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]
    backoff_limit: int
    ttl_seconds_after_finished: int | None
    signal_grace_seconds: int
    poll_seconds: float
    k8s_version: str


def settings_from(root: Any) -> K8sSettings:
    """The checked settings of the resolved root config (its `cluster` section, `container`,
    `container_mounts` and the three paths every pod must see)."""
    cluster = _plain(root.get("cluster")) or {}
    if "k8s_version" not in cluster or "volumes" not in cluster:
        raise ConfigError(
            "cluster",
            "is not the Kubernetes cluster section (conf/cluster/k8s.yaml) but cluster_type is k8s",
            "Add cluster=k8s to the command line",
        )
    if not root.get("container"):
        raise ConfigError(
            "container",
            "is not set but the k8s backend runs every job in a container image",
            "Set container=<image>, e.g. container=nvcr.io/nvidia/nemo:24.05",
        )
    if "termination_grace_seconds" in cluster:
        raise ConfigError(
            "cluster.termination_grace_seconds",
            "is now cluster.signal_grace_seconds, the same key on every backend",
            "Rename it",
        )
    volumes = _volumes(cluster.get("volumes"))
    volumes += _container_mounts(root.get("container_mounts"), len(volumes))
    _check_unique(volumes, cluster.get("shm_size"))
    for key, what in VISIBLE_PATHS:
        _check_visible(key, str(root.get(key)), what, volumes)
    gpus_per_node = cluster.get("gpus_per_node")
    return K8sSettings(
        namespace=_label("cluster.namespace", cluster.get("namespace") or "default"),
        image_pull_secrets=tuple(
            _label(f"cluster.image_pull_secrets[{index}]", name, dots=True)
            for index, name in enumerate(_list("cluster.image_pull_secrets", cluster))
        ),
        service_account=_optional_str(cluster.get("service_account")),
        gpus_per_node=None
        if gpus_per_node is None
        else require_int("cluster.gpus_per_node", gpus_per_node, 1),
        gpu_resource=_resource_name("cluster.gpu_resource", cluster.get("gpu_resource")),
        rdma_resources=tuple(
            (
                _resource_name(f"cluster.rdma_resources.{name}", name),
                require_int(f"cluster.rdma_resources.{name}", count, 1),
            )
            for name, count in _pairs("cluster.rdma_resources", cluster, strings=False)
        ),
        shm_size=_optional_str(cluster.get("shm_size")),
        cpu_request=_optional_str(cluster.get("cpu_request")),
        memory_request=_optional_str(cluster.get("memory_request")),
        volumes=tuple(volumes),
        node_selector=tuple(_pairs("cluster.node_selector", cluster)),
        tolerations=tuple(_tolerations(cluster)),
        env=tuple(_pairs("cluster.env", cluster)),
        labels=tuple(_pairs("cluster.labels", cluster)),
        annotations=tuple(_pairs("cluster.annotations", cluster)),
        backoff_limit=require_int("cluster.backoff_limit", cluster.get("backoff_limit", 0), 0),
        ttl_seconds_after_finished=None
        if cluster.get("ttl_seconds_after_finished") is None
        else require_int(
            "cluster.ttl_seconds_after_finished", cluster["ttl_seconds_after_finished"], 0
        ),
        signal_grace_seconds=signal_grace_seconds(cluster),
        poll_seconds=_seconds("cluster.poll_seconds", cluster.get("poll_seconds", 10)),
        k8s_version=_version(cluster.get("k8s_version")),
    )


# ----- volumes --------------------------------------------------------------------------------


def _volumes(entries: Any) -> list[Volume]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ConfigError(
            "cluster.volumes", "is not a list", "Give a list of {name, mount_path, …}"
        )
    volumes = []
    for index, entry in enumerate(entries):
        key = f"cluster.volumes[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(key, "is not a mapping", "Give {name, mount_path, pvc|nfs|host_path}")
        unknown = sorted(set(entry) - {"name", "mount_path", "read_only", *VOLUME_SOURCES})
        if unknown:
            raise ConfigError(
                f"{key}.{unknown[0]}",
                "is not a volume key",
                "Use name, mount_path, read_only and one of pvc, nfs, host_path",
            )
        name = _label(f"{key}.name", entry.get("name"))
        mount_path = _absolute(f"{key}.mount_path", entry.get("mount_path"))
        sources = [source for source in VOLUME_SOURCES if entry.get(source) is not None]
        if len(sources) != 1:
            given = ", ".join(sources) or "none"
            raise ConfigError(
                key,
                f"volume {name} needs exactly one source but has {given}",
                "Give one of pvc: <claim>, nfs: {server, path}, host_path: <path>",
            )
        read_only = entry.get("read_only", False)
        if not isinstance(read_only, bool):
            raise ConfigError(f"{key}.read_only", f"{read_only!r} is not true or false", "Fix it")
        source = _source(key, sources[0], entry[sources[0]], read_only)
        volumes.append(Volume(name, mount_path, source, key, read_only))
    return volumes


def _source(key: str, kind: str, value: Any, read_only: bool) -> dict[str, Any]:
    if kind == "pvc":
        claim: dict[str, Any] = {"claimName": _label(f"{key}.pvc", value, dots=True)}
        if read_only:
            claim["readOnly"] = True
        return {"persistentVolumeClaim": claim}
    if kind == "nfs":
        if not isinstance(value, dict) or not value.get("server") or not value.get("path"):
            raise ConfigError(
                f"{key}.nfs", "needs a server and a path", "Give nfs: {server: <host>, path: /x}"
            )
        unknown = sorted(set(value) - {"server", "path"})
        if unknown:
            raise ConfigError(f"{key}.nfs.{unknown[0]}", "is not an NFS key", "Use server, path")
        nfs: dict[str, Any] = {
            "server": str(value["server"]),
            "path": _absolute(f"{key}.nfs.path", value["path"]),
        }
        if read_only:
            nfs["readOnly"] = True
        return {"nfs": nfs}
    # A missing node folder is created rather than leaving the pod stuck in ContainerCreating.
    path = _absolute(f"{key}.host_path", value)
    return {"hostPath": {"path": path, "type": "DirectoryOrCreate"}}


def _container_mounts(mounts: Any, first: int) -> list[Volume]:
    """`container_mounts` ("/src" or "/src:/dst", host paths bound into the container as pyxis
    does on Slurm) become hostPath volumes of the node."""
    volumes = []
    for index, mount in enumerate(mounts or ()):
        source, _, target = str(mount).partition(":")
        target = target.split(":")[0] or source
        path = _absolute(f"container_mounts[{index}]", target)
        source_spec = {"hostPath": {"path": source, "type": "DirectoryOrCreate"}}
        key = f"container_mounts[{index}]"
        volumes.append(Volume(f"mount-{first + index}", path, source_spec, key))
    return volumes


def _check_unique(volumes: Sequence[Volume], shm_size: Any) -> None:
    names, paths = set(), set()
    if shm_size:  # the backend's own /dev/shm volume
        names.add(SHM_VOLUME)
        paths.add("/dev/shm")
    for volume in volumes:
        if volume.name in names:
            raise ConfigError(
                f"{volume.key}.name" if volume.key.startswith("cluster.") else volume.key,
                f"{volume.name} names two volumes (the backend's /dev/shm volume is {SHM_VOLUME})",
                "Give each volume its own name",
            )
        if volume.mount_path in paths:
            raise ConfigError(
                f"{volume.key}.mount_path" if volume.key.startswith("cluster.") else volume.key,
                f"two volumes are mounted at {volume.mount_path}",
                "Mount each volume at its own path",
            )
        names.add(volume.name)
        paths.add(volume.mount_path)


def _check_visible(key: str, path: str, what: str, volumes: Sequence[Volume]) -> None:
    target = PurePosixPath(path)
    if any(target.is_relative_to(volume.mount_path) for volume in volumes):
        return
    mounted = ", ".join(f"{v.name} at {v.mount_path}" for v in volumes) or "none"
    raise ConfigError(
        key,
        f"{path} is on no volume of the pods, so they could not see {what} (volumes: {mounted})",
        f"Add a cluster.volumes entry whose mount_path holds it, e.g. "
        f"{{name: work, mount_path: {path}, pvc: <claim>}}, or change {key}",
    )


# ----- scalar checks --------------------------------------------------------------------------


def _plain(node: Any) -> Any:
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _label(key: str, value: Any, dots: bool = False) -> str:
    """A DNS-1123 label; with `dots`, a DNS-1123 subdomain (Secret and claim names)."""
    text = str(value or "")
    parts = text.split(".") if dots else [text]
    if not text or len(text) > (253 if dots else 63) or not all(DNS_LABEL.match(p) for p in parts):
        raise ConfigError(
            key,
            f"{value!r} is not a valid Kubernetes name",
            "Use lowercase letters, digits and '-' (at most 63), starting and ending with a "
            "letter or digit",
        )
    return text


def _absolute(key: str, value: Any) -> str:
    text = str(value or "")
    if not text.startswith("/"):
        raise ConfigError(key, f"{value!r} is not an absolute path", "Give a path such as /data")
    return str(PurePosixPath(text))


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(key, f"{value!r} is not a positive number of seconds", "Fix the value")
    return float(value)


def _optional_str(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _resource_name(key: str, value: Any) -> str:
    text = str(value or "")
    if not re.match(r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", text):
        raise ConfigError(
            key, f"{value!r} is not a resource name", "Use e.g. nvidia.com/gpu or rdma/ib"
        )
    return text


def _version(value: Any) -> str:
    text = str(value or "")
    match = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?", text)
    if not match or (int(match[1]), int(match[2])) < MIN_K8S_VERSION:
        minimum = ".".join(map(str, MIN_K8S_VERSION))
        raise ConfigError(
            "cluster.k8s_version",
            f"{value!r} is not a Kubernetes version of at least {minimum}",
            'Give the cluster\'s version, e.g. cluster.k8s_version="1.30"',
        )
    return f"{match[1]}.{match[2]}"


def _list(key: str, cluster: Mapping[str, Any]) -> list[Any]:
    value = cluster.get(key.split(".")[-1])
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(key, f"{value!r} is not a list", f"Give a list, e.g. {key}=[a,b]")
    return value


def _pairs(key: str, cluster: Mapping[str, Any], strings: bool = True) -> list[tuple[str, Any]]:
    """A mapping's items sorted by name, values as text (null values left out)."""
    value = cluster.get(key.split(".")[-1])
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ConfigError(key, f"{value!r} is not a mapping", f"Give {key}={{name: value}}")
    items = sorted((str(name), item) for name, item in value.items() if item is not None)
    return [(name, str(item) if strings else item) for name, item in items]


def _tolerations(cluster: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    entries = _list("cluster.tolerations", cluster)
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(
                f"cluster.tolerations[{index}]",
                f"{entry!r} is not a mapping",
                "Write it as in a pod spec, e.g. {key: nvidia.com/gpu, operator: Exists, "
                "effect: NoSchedule}",
            )
    return entries
