"""Backends by `cluster_type`."""

from launcher_scripts.clusters.base import Backend, JobLog, JobRecord
from launcher_scripts.clusters.bcp import BcpBackend
from launcher_scripts.clusters.k8s import K8sBackend
from launcher_scripts.clusters.local import LocalBackend
from launcher_scripts.clusters.slurm import SlurmBackend

BACKENDS: dict[str, type] = {
    "local": LocalBackend,
    "bcm": SlurmBackend,
    "bcp": BcpBackend,
    "k8s": K8sBackend,
}

__all__ = ["BACKENDS", "Backend", "JobLog", "JobRecord"]
