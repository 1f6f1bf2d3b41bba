"""An LLM training launcher: Hydra recipes in, rendered and submitted jobs out.

Importing the package is cheap on purpose: job programs under `launcher_scripts.jobs` run on
compute nodes and must not pay for Hydra, torch or megatron-core unless they use them.
"""

__version__ = "0.1.0"
