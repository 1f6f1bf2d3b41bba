"""`python3 main.py [overrides...]`: compose the recipes, check them, run or submit the stages."""

from __future__ import annotations

import os
import sys

from omegaconf.errors import OmegaConfBaseException

from launcher_scripts.errors import LauncherError

USAGE = """usage: python3 main.py [KEY=VALUE ...]

Compose conf/config.yaml with Hydra overrides, check every requested stage, then run them in
order (cluster_type=local) or submit them to a cluster. Examples:
  python3 main.py                                   # the default: prepare the bundled sample corpus
  python3 main.py stages=[data_preparation] data_preparation=generic/custom_dataset \\
      data_preparation.raw_dataset_files=[/data/a.jsonl,/data/b.jsonl.gz]
  python3 main.py stages=[data_preparation] dry_run=true     # render and validate only
Status, logs and cancellation of a run: python3 -m launcher_scripts {status,logs,cancel} DIR
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return 0
    from launcher_scripts.__main__ import COMMANDS

    command = next((arg for arg in argv if arg in COMMANDS), None)
    if command:  # `python3 main.py status results`: Hydra would say "missing EQUAL"
        print(
            f"error: {command} is a command, not an override: run python3 -m launcher_scripts "
            f"{' '.join(argv[argv.index(command) :])} (or llm-launcher, where pip installed it)",
            file=sys.stderr,
        )
        return 2
    try:
        # Imported here so that --help and the error path stay fast.
        from launcher_scripts import pipeline

        return pipeline.run(pipeline.compose(argv), argv)
    except (LauncherError, OmegaConfBaseException) as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        code = error.exit_code if isinstance(error, LauncherError) else 2
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"error: {message}", file=sys.stderr)
        return code


def console() -> None:
    """The `llm-launcher` command installed by pip: `python3 -m launcher_scripts`, so it takes
    the same commands (status, logs, cancel, serve, ...) as well as overrides."""
    from launcher_scripts.__main__ import run

    sys.exit(run(sys.argv))
