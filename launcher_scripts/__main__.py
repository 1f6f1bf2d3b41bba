"""`python3 -m launcher_scripts status|logs|cancel RUN_DIR`, `serve EXPORT_DIR`, `install-triton`,
`merge-lora BASE PEFT OUT`,
or overrides to launch, as main.py."""

from __future__ import annotations

import difflib
import sys

OPERATIONS = ("status", "logs", "cancel")
# A command word, and the module whose main() runs it; the word is removed from argv for these.
TOOLS = {
    "serve": "launcher_scripts.jobs.export.serve",
    "merge-lora": "launcher_scripts.jobs.fine_tuning.merge_lora",
    "install-triton": "launcher_scripts.jobs.export.install",
}
COMMANDS = (*OPERATIONS, *TOOLS)


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
    command = argv[1] if argv[1:2] else ""
    if command in OPERATIONS:
        from launcher_scripts.ops import main

        return main()
    if command in TOOLS:
        import importlib

        argv.pop(1)
        return importlib.import_module(TOOLS[command]).main()
    if command and not is_launch(command):
        print(unknown_command(command), file=sys.stderr)
        return 2
    from launcher_scripts.main import main

    return main()


if __name__ == "__main__":
    sys.exit(run(sys.argv))
