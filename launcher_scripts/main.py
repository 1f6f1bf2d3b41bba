"""The command line: `python3 main.py [overrides...]` composes the recipes, checks them, runs
or submits the stages; `python3 -m launcher_scripts` (and the installed `llm-launcher`) takes
the same overrides, or a command word first (status, logs, cancel, serve, ...)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys

from omegaconf.errors import OmegaConfBaseException

from launcher_scripts.errors import LauncherError

OPERATIONS = ("status", "logs", "cancel")
# A command word, and the module whose main() runs it; the word is removed from argv for these.
TOOLS = {
    "serve": "launcher_scripts.serving",
    "client": "launcher_scripts.jobs.export.client",
    "merge-lora": "launcher_scripts.jobs.fine_tuning.merge_lora",
    "serve-reward": "launcher_scripts.jobs.inference.reward_server",
    "install-triton": "launcher_scripts.jobs.export.install",
}
COMMANDS = (*OPERATIONS, *TOOLS)

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


def is_launch(word: str) -> bool:
    """Whether the first argument starts a launch (main.py's arguments) rather than naming a
    command. Hydra overrides hold "=" (key=value, +key=value, ~key=value) or start with "~"
    (~key deletes); flags such as --help start with "-". Any other word is a command."""
    return "=" in word or word.startswith(("~", "-"))


def unknown_command(word: str) -> str:
    close = difflib.get_close_matches(word, COMMANDS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"error: unknown command {word!r}: {hint}the commands are {', '.join(COMMANDS)}; "
        f"to launch, give KEY=VALUE overrides as to main.py"
    )


def run(argv: list[str]) -> int:
    """`python3 -m launcher_scripts` with `argv` (sys.argv): a command, or a launch."""
    command = argv[1] if argv[1:2] else ""
    if command in OPERATIONS:
        from launcher_scripts.ops import main as operation

        return operation()
    if command in TOOLS:
        argv.pop(1)
        return importlib.import_module(TOOLS[command]).main()
    if command and not is_launch(command):
        print(unknown_command(command), file=sys.stderr)
        return 2
    return main()


def console() -> None:
    """The `llm-launcher` command installed by pip: `python3 -m launcher_scripts`, so it takes
    the same commands (status, logs, cancel, serve, ...) as well as overrides."""
    sys.exit(run(sys.argv))
