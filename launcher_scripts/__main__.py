"""`python3 -m launcher_scripts status|logs|cancel RUN_DIR`, `serve EXPORT_DIR`, `install-triton`,
`merge-lora BASE PEFT OUT`, `serve-reward MODEL`,
or overrides to launch, as main.py (launcher_scripts.main reads the command line)."""

from __future__ import annotations

import sys

from launcher_scripts.main import run

if __name__ == "__main__":
    sys.exit(run(sys.argv))
