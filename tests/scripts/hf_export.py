"""A portable file written back as a Hugging Face directory, as the conversion stage writes one:

python -m tests.scripts.hf_export MODEL.nemo OUT_DIR
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from launcher_scripts.formats import portable
from launcher_scripts.jobs.conversion.convert import write_hf_files


def export(model_file: Path, out: Path) -> None:
    loaded = portable.read(model_file, Path(tempfile.mkdtemp()))
    out.mkdir(parents=True)
    write_hf_files(out, loaded.config, loaded.tensors)


def main() -> None:
    export(Path(sys.argv[1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
