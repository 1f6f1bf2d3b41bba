"""Rewrite the NCCL topology files of csp_tools/<csp>/ from their descriptions
(launcher_scripts/formats/nccl_topology.py): `python3 -m csp_tools.topology`."""

from __future__ import annotations

import sys
from pathlib import Path

from launcher_scripts.formats.nccl_topology import MACHINES, render

HERE = Path(__file__).resolve().parent


def main() -> int:
    for machine in MACHINES:
        path = HERE / machine.file
        path.write_text(render(machine))
        print(f"wrote {path} ({machine.title})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
