"""README.md and docs/ stay true: every relative link resolves, and every `python3 main.py`
command of their code blocks composes and passes a dry run.

Links: a relative link's file exists, and its `#anchor` is the GitHub slug of a heading of the
target page. Commands: each one in a fenced code block (joined over `\\` line ends, comments and
what follows `&&` cut off) is dry-run in this process, as tests/test_reference_commands.py does
with the NeMo launcher's reference, from a temporary folder: relative paths land there, the
absolute example paths of the pages (/data, /models, ...) are moved under it, and
`data_dir`/`base_results_dir` go there unless the command sets them. A command that cannot
dry-run here is in CANNOT_DRY_RUN with the reason.
"""

from __future__ import annotations

import gzip
import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher_scripts.main import main
from tests.support.dry_runs import DRY_RUN_DONE, as_dry_run, continued, without_slurm

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the text may hold `code` but no brackets.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+\1")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...

# The absolute example paths the pages use; a dry run finds them missing and goes on, but it
# writes under some of them (base_results_dir=/lustre/...), so they move under tmp_path.
EXAMPLE_ROOTS = ("data", "lustre", "models", "mount", "secrets", "tmp", "tok")
EXAMPLE_PATH = re.compile(rf"(?<![\w./-])/({'|'.join(EXAMPLE_ROOTS)})(?=/|\b)")


@dataclass(frozen=True)
class Refused:
    """A documented command that cannot dry-run here: why, and the key its one-line refusal
    names (so the test still sees it compose and reach that check)."""

    why: str
    key: str


# By a piece of the command only it holds.
CANNOT_DRY_RUN: dict[str, Refused] = {
    "conversion.hf_model_dir=/models/": Refused(
        "the import's preflight reads the Hugging Face directory's config.json, in a dry run "
        "too (tests/test_gpt_hf_import.py and tests/test_t5_hf_import.py run the import on "
        "real tiny models)",
        "conversion.hf_model_dir",
    ),
    "conversion=hf_export": Refused(
        "the export's family comes from the portable file's model_config.yaml, read in a dry "
        "run too (tests/test_gpt_hf_import.py runs the export of an imported and tuned model)",
        "conversion.nemo_file",
    ),
    "cluster.exclude_unhealthy=true": Refused(
        "it reads the newest cluster validation verdict, which only csp_tools' validation "
        "writes (tests/test_node_exclusion.py renders it from one)",
        "cluster.validation_results",
    ),
}


@dataclass(frozen=True)
class Line:
    number: int
    text: str
    fence: str | None  # the language of the code block it is in ("" for none); None: prose


def page_lines(page: Path) -> list[Line]:
    """Every line of a page, with the code block it belongs to (fence lines included)."""
    lines, fence = [], None
    for number, text in enumerate(page.read_text().splitlines(), start=1):
        opening = FENCE.match(text)
        if opening and fence is None:
            fence = text.strip()[len(opening.group(1)) :].strip()
            lines.append(Line(number, text, fence))
        elif opening:
            lines.append(Line(number, text, fence))
            fence = None
        else:
            lines.append(Line(number, text, fence))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lower-cased, punctuation other than
    '-' and '_' dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for line in page_lines(page):
        heading = HEADING.match(line.text)
        if line.fence is not None or not heading:
            continue
        base = slug(heading.group(2))
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}: {self.target}"

    def problem(self) -> str | None:
        path, _, anchor = self.target.partition("#")
        target = (self.page.parent / path).resolve() if path else self.page
        if not target.exists():
            return f"{target} does not exist"
        if anchor and target.suffix == ".md" and anchor not in anchors(target):
            return f"{target.name} has no heading with the anchor #{anchor}"
        return None


def relative_links(page: Path) -> list[Link]:
    """The page's links outside code, a link's text may run over a line end."""
    prose = "\n".join(
        INLINE_CODE.sub("", line.text) if line.fence is None else "" for line in page_lines(page)
    )
    links = []
    for match in LINK.finditer(prose):
        target = match.group(1)
        if not EXTERNAL.match(target):
            links.append(Link(page, prose.count("\n", 0, match.start()) + 1, target))
    return links


LINKS = [link for page in PAGES for link in relative_links(page)]


def test_the_pages_have_links() -> None:
    """The scan sees the README's links into docs/ and anchors (a broken pattern would find
    none)."""
    assert any(link.page.name == "README.md" and "docs/" in link.target for link in LINKS)
    assert any("#" in link.target for link in LINKS)


def test_the_scan_reads_links_as_github_renders_them(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A `code` heading: (with) punctuation\n"
        "Text [over a\nline end](other.md#a-code-heading-with-punctuation), `[code](no.md)`,\n"
        "[a site](https://example.com) and [here](#a-code-heading-with-punctuation).\n"
        "```\n[in a block](no.md)\n```\n"
        "## Twice\n## Twice\n"
    )
    found = [(link.line, link.target) for link in relative_links(page)]
    assert found == [
        (2, "other.md#a-code-heading-with-punctuation"),
        (4, "#a-code-heading-with-punctuation"),
    ]
    assert anchors(page) == {"a-code-heading-with-punctuation", "twice", "twice-1"}


@pytest.mark.parametrize("link", LINKS, ids=str)
def test_relative_link_resolves(link: Link) -> None:
    assert link.problem() is None, f"{link}: {link.problem()}"


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str  # as written, continuations joined

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def overrides(self) -> list[str]:
        """The words after `python3 main.py`, up to the end of its shell command."""
        words = shlex.split(self.text, comments=True)
        start = next(
            i for i in range(len(words) - 1) if words[i] == "python3" and words[i + 1] == "main.py"
        )
        args = []
        for word in words[start + 2 :]:
            if word in ("&&", "||", ";", "|") or word.startswith((">", "2>")):
                break
            args.append(word)
        return args

    def refused(self) -> Refused | None:
        return next((entry for piece, entry in CANNOT_DRY_RUN.items() if piece in self.text), None)


SHELL_FENCES = ("", "sh", "bash", "shell", "console")
MAIN = re.compile(r"(^|\s|&&\s*)python3 main\.py(\s|$)")


def page_commands(page: Path) -> list[Command]:
    """The commands of the page's shell code blocks (no language, or a shell's)."""
    commands = []
    lines = page_lines(page)
    index = 0
    while index < len(lines):
        line = lines[index]
        shell = line.fence in SHELL_FENCES and not FENCE.match(line.text)
        if shell and MAIN.search(line.text):
            joined, index = continued([each.text for each in lines], index)
            commands.append(Command(page, line.number, joined))
        index += 1
    return commands


COMMANDS = [command for page in PAGES for command in page_commands(page)]


def test_the_pages_have_commands() -> None:
    """The scan sees the README's first command and a continued one."""
    readme = [c for c in COMMANDS if c.page.name == "README.md"]
    assert any(c.overrides == [] for c in readme), "the README's `python3 main.py` is not seen"
    assert any("\\" in c.page.read_text().splitlines()[c.line - 1] for c in COMMANDS)


def test_every_cannot_dry_run_entry_names_a_command() -> None:
    for piece in CANNOT_DRY_RUN:
        assert any(piece in command.text for command in COMMANDS), piece


DOCUMENT = "A document of the user's own data."


def write_documents(path: Path) -> None:
    """A data file (JSON lines, gzipped or not) or a folder of text files."""
    if not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        (path / "a.txt").write_text(DOCUMENT + "\n")
        return
    line = json.dumps({"text": DOCUMENT}) + "\n"
    path.write_bytes(gzip.compress(line.encode()) if path.suffix == ".gz" else line.encode())


def write_tokenizer(path: Path) -> None:
    """A Hugging Face tokenizer.json (the only kind the pages name)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    assert path.name.endswith(".json"), f"{path}: write a tokenizer of this kind here"
    tokenizer = Tokenizer(
        WordLevel({"[UNK]": 0, **{w: i for i, w in enumerate(DOCUMENT.split(), 1)}}, "[UNK]")
    )
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))


def write_key_file(path: Path) -> None:
    path.write_text("the W&B key would be here\n")


# Overrides naming files a user has before a run, which a dry run checks too: the test writes
# one of each where a page names it under an example root.
USER_FILES = {
    "data_preparation.raw_dataset_files": write_documents,
    "data_preparation.tokenizer_model": write_tokenizer,
    "wandb_api_key_file": write_key_file,
}


def adapted(command: Command, root: Path) -> list[str]:
    """The command's overrides with the pages' example paths under `root`, as a dry run: the
    files a user brings are written there, and a `launcher_scripts_path` there is this
    checkout (a link to it), as the cluster's copy of the code would be."""
    args = [EXAMPLE_PATH.sub(lambda m: f"{root}/{m.group(1)}", word) for word in command.overrides]
    args = [arg for arg in args if not arg.startswith("dry_run=")]
    for arg in args:
        key, _, value = arg.partition("=")
        paths = [p for p in value.strip("[]'\"").split(",") if p.startswith(f"{root}/")]
        if key.lstrip("+") in USER_FILES:
            for path in paths:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                USER_FILES[key.lstrip("+")](Path(path))
        elif key == "launcher_scripts_path" and paths:
            Path(paths[0]).parent.mkdir(parents=True, exist_ok=True)
            Path(paths[0]).symlink_to(REPO, target_is_directory=True)
    return as_dry_run(args, root)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_documented_command_dry_runs(
    command: Command,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths (results/..., data/...) land here
    without_slurm(monkeypatch)
    args = adapted(command, tmp_path)
    code = main(args)
    out, err = capsys.readouterr()
    refused = command.refused()
    if refused is None:
        assert code == 0, f"{command}: {command.text}\n{args}\n{err}"
        assert DRY_RUN_DONE in out, out
    else:
        # It composes and is refused in one line at the check it cannot pass here.
        assert code == 2, f"{command} dry-runs now: take it out of CANNOT_DRY_RUN ({refused.why})"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {refused.key}"), err
