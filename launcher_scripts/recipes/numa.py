"""The `numa_mapping` settings a job's processes are bound by: what preflight checks and what
the stages pass to the binding wrapper (launcher_scripts.jobs.numa_binding)."""

from __future__ import annotations

from dataclasses import dataclass

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
