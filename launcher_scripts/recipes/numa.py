"""The `numa_mapping` settings a job's processes are bound by: what preflight checks and what
the stages pass to the binding wrapper (launcher_scripts.jobs.numa_binding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher_scripts.config.checks import require_choice, require_int
from launcher_scripts.errors import ConfigError

MODES = ("all", "single", "single_unique", "unique_interleaved", "unique_contiguous")
SCOPES = ("node", "socket")
CORES = ("all_logical", "single_logical")


@dataclass(frozen=True)
class NumaPolicy:
    """The numa_mapping section of the configuration (less `enable`)."""

    mode: str = "unique_contiguous"
    scope: str = "node"
    cores: str = "all_logical"
    balanced: bool = True
    min_cores: int = 1
    max_cores: int | None = None

    def args(self, local_ranks: int) -> tuple[str, ...]:
        """The wrapper's options for a job of `local_ranks` processes per node."""
        return (
            f"--mode={self.mode}",
            f"--scope={self.scope}",
            f"--cores={self.cores}",
            f"--balanced={str(self.balanced).lower()}",
            f"--min-cores={self.min_cores}",
            f"--max-cores={'null' if self.max_cores is None else self.max_cores}",
            f"--local-ranks={local_ranks}",
        )


def check_section(numa: Any) -> None:
    """The `numa_mapping` section of a run, checked in preflight: each wrong value refused in
    one line naming its key."""
    for flag in ("enable", "balanced"):
        if not isinstance(numa.get(flag), bool):
            raise ConfigError(
                f"numa_mapping.{flag}", f"{numa.get(flag)!r} is not true or false", "Fix it"
            )
    require_choice("numa_mapping.mode", numa.mode, MODES)
    require_choice("numa_mapping.scope", numa.scope, SCOPES)
    require_choice("numa_mapping.cores", numa.cores, CORES)
    require_int("numa_mapping.min_cores", numa.min_cores)
    if numa.max_cores is not None and require_int("numa_mapping.max_cores", numa.max_cores) < (
        numa.min_cores
    ):
        raise ConfigError(
            "numa_mapping.max_cores", "is below min_cores", "Raise max_cores or lower min_cores"
        )
