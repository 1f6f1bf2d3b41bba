"""The job programs: what runs on the compute nodes, started by the rendered job scripts."""

from launcher_scripts.jobs.benign_warnings import install as _quiet_benign_warnings
from launcher_scripts.jobs.megatron_import import install as _lighter_megatron_import

_quiet_benign_warnings()
_lighter_megatron_import()
