"""Backends by `cluster_type`."""

from launcher_scripts.clusters.base import Backend, JobRecord
from launcher_scripts.clusters.local import LocalBackend

BACKENDS: dict[str, type] = {"local": LocalBackend}

__all__ = ["BACKENDS", "Backend", "JobRecord"]
