"""Backends by `cluster_type`."""

from launcher_scripts.clusters.base import Backend, JobLog, JobRecord
from launcher_scripts.clusters.bcp import BcpBackend
from launcher_scripts.clusters.local import LocalBackend
from launcher_scripts.clusters.slurm import SlurmBackend

BACKENDS: dict[str, type] = {"local": LocalBackend, "bcm": SlurmBackend, "bcp": BcpBackend}

__all__ = ["BACKENDS", "Backend", "JobLog", "JobRecord"]
