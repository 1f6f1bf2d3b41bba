"""Stand-ins for the programs rendered scripts call (python3, srun, scontrol, bcprun, ngc), so a
script runs end to end on any machine: each records its argv, working folder and a few variables
as a JSON line in $STANDIN_LOG, then does the little of its job the script needs.

Usage: standin.py ROLE ARGS... (tests put one small `exec` wrapper per role on PATH).
"""

from __future__ import annotations

import json
import os
import sys

RECORDED_VARIABLES = ("LAUNCHER_TEST", "PYTHONPATH", "WANDB_API_KEY_FILE")


def record(role: str, argv: list[str]) -> None:
    entry = {
        "role": role,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": {name: os.environ.get(name) for name in RECORDED_VARIABLES},
    }
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\n")


def python3(argv: list[str]) -> None:
    if "launcher_scripts.formats.progress" in argv:
        print(0)  # the latest checkpoint step, which a requeueable Slurm job compares


def srun(argv: list[str]) -> None:
    """Run the program after srun's options once, as task 0 of 1."""
    program = next(index for index, arg in enumerate(argv) if not arg.startswith("-"))
    os.environ.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0")
    os.execvp(argv[program], argv[program:])


def scontrol(argv: list[str]) -> None:
    if argv[:2] == ["show", "hostnames"]:
        print("node0")


def bcprun(argv: list[str]) -> None:
    """Run `-c COMMAND` with bash once, in --workdir, with each --env NAME=VALUE set."""
    options: dict[str, str] = {}
    position = 0
    while position < len(argv):
        option, value = argv[position], argv[position + 1]
        if option == "--env":
            name, _, text = value.partition("=")
            os.environ[name] = text
        elif option in ("--nnodes", "--npernode", "--workdir", "-c"):
            options[option] = value
        else:
            raise SystemExit(f"bcprun stand-in: unknown option {option}")
        position += 2
    os.chdir(options["--workdir"])
    os.execvp("bash", ["bash", "-c", options["-c"]])


def ngc(argv: list[str]) -> None:
    """`ngc batch run ... --commandline C`: run C with bash, as the BCP job would."""
    os.execvp("bash", ["bash", "-c", argv[argv.index("--commandline") + 1]])


if __name__ == "__main__":
    role, arguments = sys.argv[1], sys.argv[2:]
    record(role, arguments)
    {"python3": python3, "srun": srun, "scontrol": scontrol, "bcprun": bcprun, "ngc": ngc}[role](
        arguments
    )
