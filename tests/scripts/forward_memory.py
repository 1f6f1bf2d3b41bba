"""Peak memory of the runner's forward passes against memory.py's estimate, printed as JSON.

python -m tests.scripts.forward_memory MODEL_FILE ROWSxWIDTH...

Each pass runs once to warm up, then again with the process's peak resident size reset
(/proc/self/clear_refs): its peak above the resident size before it is what the pass took.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher_scripts.jobs.inference.runner import close_runner, open_runner


def kib_field(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    runner = open_runner(Path(sys.argv[1]))
    shape = runner.forward_shape()
    out = []
    for size in sys.argv[2:]:
        rows, width = (int(n) for n in size.split("x"))
        batch = [[5] * width for _ in range(rows)]
        runner.logits(batch)
        Path("/proc/self/clear_refs").write_text("5")
        before = kib_field("VmRSS")
        logits = runner.logits(batch)
        measured = kib_field("VmHWM") - before
        del logits
        device, host = shape.bytes_needed(rows, width)
        out.append({"rows": rows, "width": width, "measured": measured, "estimate": host})
    close_runner()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
