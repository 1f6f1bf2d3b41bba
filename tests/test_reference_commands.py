"""Every `python3 main.py ...` command of the NeMo launcher's reference runs here as documented.

The reference (`../shared/reference/launcher-reference.md` beside the checkout) is what users of
the launcher we replace have: each command in its code blocks (joined over `\\` line ends, output
redirections cut off) is dry-run with its paths moved under a temporary folder. It composes and
passes preflight, or it is in OUTSIDE below with the reason, and is refused with one line.

The reference often says to edit conf/config.yaml first ("set the conf/config.yaml file to:" and
a YAML block of stages and recipe choices) and then run a bare `python3 main.py`: that block,
the last one of the command's section, becomes overrides ahead of the command's own.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from launcher_scripts.config.compose import compose_config, config_groups
from launcher_scripts.main import main
from tests.support import REPO, missing
from tests.support.dry_runs import DRY_RUN_DONE, as_dry_run, continued, without_slurm

REFERENCE = REPO.parent / "shared" / "reference" / "launcher-reference.md"
IMAGE = "nvcr.io/nvidia/nemo:24.05"

# Paths of the reference's machines, and what they are here.
NEMO_CHECKOUT = "/opt/NeMo-Megatron-Launcher"
MOUNTS = ("/mount/data", "/mount/results", "/raid", "/lustre")

# Sections whose text names the recipe conf/config.yaml must choose, with no YAML block for it.
SECTION_SETTINGS = {
    # 5.1.2.1: 'The default value is set to download_gpt3_pile' (for GPT models)
    "5.1.2.1": ("data_preparation=gpt3/download_gpt3_pile",),
    # 5.1.2.4: 'The default value is set to download_bert_pile' (for BERT models)
    "5.1.2.4": ("data_preparation=bert/download_bert_pile",),
}

# Commands outside this launcher by design, by a piece of the command only it holds: why, and
# what its one-line refusal names (the AutoConfigurator's is not main.py's and is not run).
OUTSIDE: dict[str, tuple[str, str | None]] = {
    "auto_configurator/main.py": (
        "the AutoConfigurator's program, not main.py: it measures by running training jobs, "
        "so it has no dry run (tests/test_autoconfig_*.py run it, on local, Slurm and BCP)",
        None,
    ),
    "evaluation.model.nemo_model=4": (
        "the reference's slip: nemo_model is given twice, the second time as 4; NeMo's "
        "nemo_model of a prompt-learning evaluation is model.virtual_prompt_model_file here",
        "model.virtual_prompt_model_file",
    ),
}


@dataclass(frozen=True)
class Command:
    line: int  # where it starts in the reference
    section: str  # its heading's number, e.g. "5.1.2.4.2"
    text: str  # as written, continuations joined
    settings: tuple[str, ...]  # overrides from the section's conf/config.yaml block

    @property
    def words(self) -> list[str]:
        words = shlex.split(self.text)
        for index, word in enumerate(words):
            if re.fullmatch(r"\d*>>?(&\d+)?|\d*>&\d+", word) or word.startswith((">", "2>")):
                return words[:index]
        return words

    def outside(self) -> tuple[str, str | None] | None:
        return next((entry for piece, entry in OUTSIDE.items() if piece in self.text), None)


HEADING = re.compile(r"#{1,6}\s+(\d+(?:\.\d+)*)")
COMMAND = re.compile(r"\s*python3\s+\S*main\.py(\s|$)")


def config_settings(block: str) -> tuple[str, ...] | None:
    """A YAML block of conf/config.yaml settings as overrides; None for any other block."""
    try:
        loaded = yaml.safe_load(block)
    except yaml.YAMLError:
        return None
    root_keys = {"stages", "cluster_type", *config_groups()}
    if not isinstance(loaded, dict) or not loaded or not set(loaded) <= root_keys:
        return None
    # The block edits NeMo's conf/config.yaml, whose cluster_type is bcm (this launcher's is
    # local, which runs no job of several nodes).
    overrides = [] if {"cluster", "cluster_type"} & set(loaded) else ["cluster_type=bcm"]
    for key, value in loaded.items():
        if key == "stages" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            overrides.append(f"stages=[{','.join(value)}]")
        elif key == "cluster" and isinstance(value, str):
            # "The cluster and cluster_type parameters in conf/config.yaml must be set to bcm"
            # (the reference's Slurm sections); NeMo's conf/config.yaml has cluster_type: bcm.
            overrides += [f"cluster={value}", f"cluster_type={value}"]
        elif key != "stages" and isinstance(value, str):
            overrides.append(f"{key}={value}")
        else:
            return None
    return tuple(overrides)


def reference_commands(text: str) -> list[Command]:
    commands: list[Command] = []
    lines = text.splitlines()
    section, settings = "", ()
    fence: str | None = None  # the language of the open code block
    block: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.strip().startswith("```"):
            if fence is None:
                fence, block = line.strip()[3:].strip(), []
            else:
                if fence == "yaml":
                    settings = config_settings("\n".join(block)) or settings
                fence = None
            index += 1
            continue
        if fence is None:
            heading = HEADING.match(line)
            if heading:
                section, settings = heading.group(1), ()
        elif COMMAND.match(line):
            start = index
            joined, index = continued(lines, index)
            words = section.split(".")
            extra = next(
                (
                    SECTION_SETTINGS[".".join(words[:n])]
                    for n in range(len(words), 0, -1)
                    if ".".join(words[:n]) in SECTION_SETTINGS
                ),
                (),
            )
            commands.append(Command(start + 1, section, joined, (*extra, *settings)))
        else:
            block.append(line)
        index += 1
    return commands


def load_commands() -> list[Command]:
    return reference_commands(REFERENCE.read_text()) if REFERENCE.is_file() else []


COMMANDS = load_commands()


def test_the_reference_is_there() -> None:
    if REFERENCE.is_file():
        assert len(COMMANDS) > 50, "the reference's commands were not found"
        return
    missing(f"{REFERENCE} is missing: the shared/ folder belongs beside the checkout")


def test_every_outside_entry_names_a_command() -> None:
    if not COMMANDS:
        pytest.skip("no reference")
    for piece in OUTSIDE:
        assert any(piece in command.text for command in COMMANDS), piece


def adapted(command: Command, root: Path) -> list[str]:
    """The command's overrides for this checkout and a temporary folder, as a dry run."""
    args = []
    for word in command.words[2:]:
        word = word.replace(f"{NEMO_CHECKOUT}/launcher_scripts", str(REPO))
        word = word.replace(NEMO_CHECKOUT, str(REPO))
        for mount in MOUNTS:
            word = word.replace(mount, f"{root}{mount}")
        args.append(word)
    args = [*command.settings, *args]
    if any("$NGC_ARRAY_SIZE" in arg for arg in args):
        # The BCP job's replicas: the nodes the recipe trains on.
        training = [a.partition("=")[2] for a in args if a.startswith("training=")]
        nodes = compose_config([f"training={training[-1]}"]).training.trainer.num_nodes
        args = [arg.replace("\\$NGC_ARRAY_SIZE", str(nodes)) for arg in args]
        args = [arg.replace("$NGC_ARRAY_SIZE", str(nodes)) for arg in args]
    if "cluster_type=bcp" in args:
        # NeMo's conf/config.yaml names its container; this launcher ships none.
        args.append(f"container={IMAGE}")
    return as_dry_run(args, root)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"line{c.line}" for c in COMMANDS])
def test_reference_command_dry_runs(
    command: Command,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outside = command.outside()
    if outside is not None and outside[1] is None:
        return  # not main.py: see OUTSIDE
    assert command.words[1].endswith("launcher_scripts/main.py") or command.words[1] == "main.py"
    without_slurm(monkeypatch)
    args = adapted(command, tmp_path)
    code = main(args)
    out, err = capsys.readouterr()
    if outside is None:
        assert code == 0, f"{command.text}\n{args}\n{err}"
        assert DRY_RUN_DONE in out
    else:
        # Outside by design, and said so in one line that names what to use.
        assert code == 2, f"{command.text}\n{out}\n{err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert outside[1] in lines[0], lines[0]
