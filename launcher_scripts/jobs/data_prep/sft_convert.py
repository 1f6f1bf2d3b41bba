"""Convert question-answering and instruction datasets into the SFT JSON-lines format that the
fine-tuning and PEFT stages read: one JSON object per line with "input" and "output".

    python3 -m launcher_scripts.jobs.data_prep.sft_convert squad \\
        --input train-v1.1.json --output train-v1.1_gpt.json [--all-answers] \\
        [--text-to-text train-v1.1_src.txt train-v1.1_tgt.txt]
    python3 -m launcher_scripts.jobs.data_prep.sft_convert squad-prompt \\
        --input train-v1.1.json --output squad_train.jsonl \\
        [--validation squad_val.jsonl --validation-fraction 0.1 --seed 1234] [--all-answers]
    python3 -m launcher_scripts.jobs.data_prep.sft_convert dolly \\
        --input databricks-dolly-15k.jsonl --seed 1234 \\
        --split train 0.9 dolly_train.jsonl --split validation 0.1 dolly_validation.jsonl

squad: a SQuAD v1.1 JSON file ({"data": [{"paragraphs": [{"context", "qas": [...]}]}]}). Each
question is one line: "input" is "Context: {context} Question: {question} Answer:", "output"
the first answer's text; --all-answers adds "original_answers", every answer's text (dev sets
have several, and exact match accepts any). Questions without answers (SQuAD 2.0's impossible
ones) are skipped and counted. The file is one JSON document (the official ones are one line),
so a bad question is located by its place in it, e.g. data[3].paragraphs[0].qas[7].
--text-to-text writes T5's layout: line i of SRC is "question: {question} context: {context}",
line i of TGT its first answer (XQuAD's files have SQuAD's format and convert the same way).

squad-prompt: the same questions as NeMo's prompt-learning records, {"taskname": "squad",
"context", "question", "answer"} (the first answer; --all-answers adds original_answers);
--validation moves a seeded --validation-fraction of them to a second file.

dolly: JSON lines {"instruction", "context", "response", "category"}. "input" is
"{context}\\n\\n{instruction}" when the context is not blank, else the instruction (both with
surrounding whitespace removed); "output" is the response as given; "category" is kept when
present. With --split the good records are shuffled with --seed and dealt out so that each
split gets its fraction of them (rounded to whole records, largest remainders first); each
split keeps the input order. A bad line is reported by file and line number.

Bad records (not JSON, a field missing, empty or of the wrong type) never stop the read: they
are counted and the first few reported; the job fails if more than --max-bad-fraction of the
records are bad. Outputs are written under a temporary name and renamed into place only when
the whole conversion succeeded, so a reader never sees a partial file. Exit status: 0 done,
1 failed (told in one line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launcher_scripts.formats.shards import SPLIT_NAMES
from launcher_scripts.jobs.data_prep.readers import ReadStats, open_input, report_bad


class ConvertError(Exception):
    """An expected failure, reported as one line without a traceback."""


@dataclass(frozen=True)
class Split:
    name: str
    fraction: float
    output: Path


# ---- writing -----------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[Path]) -> Iterator[list[IO[bytes]]]:
    """One binary file per path, opened under a temporary name beside it; when the block ends
    without an error every one is renamed into place, otherwise every one is removed."""
    temporaries = [path.with_name(f".{path.name}.{os.getpid()}.tmp") for path in paths]
    files: list[IO[bytes]] = []
    try:
        for path, temporary in zip(paths, temporaries, strict=True):
            path.parent.mkdir(parents=True, exist_ok=True)
            files.append(open(temporary, "wb"))  # noqa: SIM115 - closed below
        yield files
        for file in files:
            file.close()
        for path, temporary in zip(paths, temporaries, strict=True):
            os.replace(temporary, path)
    finally:
        for file in files:
            file.close()
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)


def encode(record: dict[str, Any]) -> bytes | str:
    """The record as one UTF-8 JSON line, or why it cannot be (a lone surrogate from a
    \\ud800-style escape in the input has no UTF-8 form)."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return "a text holds a lone surrogate (invalid Unicode)"


def check_bad_fraction(stats: ReadStats, label: str, limit: float, outputs: str) -> None:
    for line in report_bad(stats, label):
        print(line, file=sys.stderr)
    fraction = stats.bad / stats.records if stats.records else 0.0
    if fraction > limit:
        raise ConvertError(
            f"{label}: {stats.bad} of {stats.records} records ({fraction:.2%}) are bad, more "
            f"than --max-bad-fraction {limit:g}; {outputs} not written. Fix the input or raise "
            "--max-bad-fraction (the recipe's max_bad_fraction)"
        )


# ---- SQuAD -------------------------------------------------------------------------------


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _text_problem(name: str, value: Any) -> str | None:
    """Why `value`, the record's `name`, is not a non-blank text; None when it is."""
    if value is None:
        return f"'{name}' missing"
    if not isinstance(value, str):
        return f"'{name}' not a string"
    return None if value.strip() else f"'{name}' empty"


@dataclass(frozen=True)
class SquadQuestion:
    context: str
    question: str
    answers: list[str]  # every answer's text; the first is the label

    def jsonl(self, all_answers: bool) -> bytes | str:
        record: dict[str, Any] = {
            "input": f"Context: {self.context} Question: {self.question} Answer:",
            "output": self.answers[0],
        }
        if all_answers:
            record["original_answers"] = self.answers
        return encode(record)

    def prompt_record(self, all_answers: bool) -> bytes | str:
        """NeMo's prompt-learning record of the question (the squad task's template fields:
        prompt_learning/gpt3/squad and the adapter and IA3 recipes read these)."""
        record: dict[str, Any] = {
            "taskname": "squad",
            "context": self.context,
            "question": self.question,
            "answer": self.answers[0],
        }
        if all_answers:
            record["original_answers"] = self.answers
        return encode(record)

    def text_pair(self) -> tuple[bytes, bytes] | str:
        """(input line, answer line) as T5 read SQuAD: "question: ... context: ...", the
        first answer; line breaks inside a text become spaces."""
        source = f"question: {_one_line(self.question)} context: {_one_line(self.context)}"
        lines = (source + "\n", _one_line(self.answers[0]) + "\n")
        try:
            return lines[0].encode("utf-8"), lines[1].encode("utf-8")
        except UnicodeEncodeError:
            return "a text holds a lone surrogate (invalid Unicode)"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def squad_question(context: str, qa: Any) -> SquadQuestion | str | None:
    """One question; a str says why it is bad; None: it has no answers."""
    if not isinstance(qa, dict):
        return "not a JSON object"
    question = qa.get("question")
    problem = _text_problem("question", question)
    if problem:
        return problem
    answers = qa.get("answers")
    if not isinstance(answers, list):
        return "'answers' missing" if answers is None else "'answers' not a list"
    if not answers:
        return None
    texts = [answer.get("text") if isinstance(answer, dict) else None for answer in answers]
    for number, text in enumerate(texts):
        if not _text(text):
            return f"answers[{number}] has no answer text"
    return SquadQuestion(context, question, texts)


def iter_squad(document: Any, path: str, stats: ReadStats) -> Iterator[SquadQuestion | None]:
    """The questions of a parsed SQuAD document, None for each question without answers; bad
    questions (and malformed articles or paragraphs, one record each) go to `stats`."""
    for i, article in enumerate(document["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            stats.records += 1
            stats.add_bad(path, 0, f"data[{i}]: no 'paragraphs' list")
            continue
        for j, paragraph in enumerate(paragraphs):
            where = f"data[{i}].paragraphs[{j}]"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not _text(context) or not isinstance(qas, list):
                stats.records += 1
                missing = "'context' text" if not _text(context) else "'qas' list"
                stats.add_bad(path, 0, f"{where}: no {missing}")
                continue
            for k, qa in enumerate(qas):
                stats.records += 1
                question = squad_question(context, qa)
                if isinstance(question, str):
                    qid = qa.get("id") if isinstance(qa, dict) else None
                    name = f" (id {qid})" if isinstance(qid, str | int) else ""
                    stats.add_bad(path, 0, f"{where}.qas[{k}]{name}: {question}")
                    continue
                yield question


def load_squad(path: Path) -> Any:
    try:
        with open_input(path) as stream:
            document = json.load(stream)
    except (OSError, EOFError) as error:
        raise ConvertError(f"cannot read {path}: {error}") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ConvertError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise ConvertError(f"{path} has no top-level 'data' list: it is not a SQuAD file")
    return document


def convert_squad(args: argparse.Namespace) -> int:
    """JSON lines (--output) and/or text-to-text line pairs (--text-to-text SRC TGT)."""
    source = Path(args.input)
    pair = [Path(p) for p in args.text_to_text or ()]
    outputs = ([Path(args.output)] if args.output else []) + pair
    if not outputs:
        raise ConvertError("give --output, --text-to-text SRC TGT, or both")
    named = ", ".join(str(path) for path in outputs)
    document = load_squad(source)
    stats = ReadStats()
    written = unanswered = 0
    with atomic_outputs(outputs) as files:
        jsonl = files[0] if args.output else None
        sources, targets = files[-2:] if pair else (None, None)
        for question in iter_squad(document, str(source), stats):
            if question is None:
                unanswered += 1
                continue
            line = question.jsonl(args.all_answers) if jsonl else b""
            lines = question.text_pair() if pair else (b"", b"")
            problem = next((p for p in (line, lines) if isinstance(p, str)), None)
            if problem is not None:
                stats.add_bad(str(source), 0, f"question {question.question[:40]!r}: {problem}")
                continue
            if jsonl is not None:
                jsonl.write(line)  # type: ignore[arg-type]
            if sources is not None and targets is not None:
                sources.write(lines[0])
                targets.write(lines[1])
            written += 1
        check_bad_fraction(stats, str(source), args.max_bad_fraction, named)
        if not written:
            raise ConvertError(f"{source} has no question with an answer; {named} not written")
    print(
        f"squad: {source}: {written} questions written to {named}; {unanswered} without "
        f"answers skipped; {stats.bad} bad of {stats.records} records"
    )
    return 0


def convert_squad_prompt(args: argparse.Namespace) -> int:
    """Prompt-learning records (--output), a seeded share of them moved to --validation."""
    source = Path(args.input)
    outputs = [Path(args.output), *([Path(args.validation)] if args.validation else [])]
    named = ", ".join(str(path) for path in outputs)
    stats = ReadStats()
    lines: list[bytes] = []
    unanswered = 0
    for question in iter_squad(load_squad(source), str(source), stats):
        if question is None:
            unanswered += 1
            continue
        line = question.prompt_record(args.all_answers)
        if isinstance(line, str):
            stats.add_bad(str(source), 0, f"question {question.question[:40]!r}: {line}")
            continue
        lines.append(line)
    check_bad_fraction(stats, str(source), args.max_bad_fraction, named)
    if not lines:
        raise ConvertError(f"{source} has no question with an answer; {named} not written")
    share = args.validation_fraction if args.validation else 0.0
    assignment = assign_splits(len(lines), [1.0 - share, share], args.seed)
    with atomic_outputs(outputs) as files:
        for line, split in zip(lines, assignment, strict=True):
            files[split].write(line)
    counts = [assignment.count(index) for index in range(len(outputs))]
    written = ", ".join(f"{n} to {path}" for n, path in zip(counts, outputs, strict=True))
    print(f"squad-prompt: {source}: {written}; {unanswered} without answers skipped")
    return 0


# ---- Dolly -------------------------------------------------------------------------------


def dolly_line(record: Any) -> bytes | str:
    """One Dolly record as an output line, or why it is bad."""
    if not isinstance(record, dict):
        return "not a JSON object"
    instruction, context = record.get("instruction"), record.get("context")
    response, category = record.get("response"), record.get("category")
    problem = _text_problem("instruction", instruction) or _text_problem("response", response)
    if problem:
        return problem
    if context is not None and not isinstance(context, str):
        return "'context' not a string"
    if category is not None and not isinstance(category, str):
        return "'category' not a string"
    context = (context or "").strip()
    prompt = f"{context}\n\n{instruction.strip()}" if context else instruction.strip()
    converted = {"input": prompt, "output": response}
    if category is not None:
        converted["category"] = category
    return encode(converted)


def iter_dolly(path: Path, stats: ReadStats) -> Iterator[bytes]:
    """Output lines of the good records; bad ones go to `stats` with their line numbers."""
    return iter_converted(path, stats, dolly_line)


def iter_converted(
    path: Path, stats: ReadStats, convert: Callable[[Any], bytes | list[bytes] | str]
) -> Iterator[bytes]:
    """The output lines `convert` makes of each JSON line of `path` (one, or several for a
    record that makes several); a str from it says why the record is bad, and goes to
    `stats` with its line number. Blank lines are not records."""
    try:
        with open_input(path) as stream:
            for number, raw in enumerate(stream, 1):
                stats.lines += 1
                if not raw.strip():
                    continue
                stats.records += 1
                try:
                    record = json.loads(raw)
                except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
                    stats.add_bad(str(path), number, "not valid JSON")
                    continue
                lines = convert(record)
                if isinstance(lines, str):
                    stats.add_bad(str(path), number, lines)
                    continue
                yield from [lines] if isinstance(lines, bytes) else lines
    except (OSError, EOFError) as error:
        raise ConvertError(f"cannot read {path}: {error}") from None


def split_sizes(total: int, fractions: Sequence[float]) -> list[int]:
    """Whole-record sizes proportional to `fractions` (which sum to 1) that sum to `total`:
    each gets the floor of its share, the records left over go to the largest remainders
    (the earlier split on a tie)."""
    shares = [total * fraction for fraction in fractions]
    sizes = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (sizes[i] - shares[i], i))
    for index in by_remainder[: total - sum(sizes)]:
        sizes[index] += 1
    return sizes


def assign_splits(total: int, fractions: Sequence[float], seed: int) -> bytearray:
    """The split index of each of `total` records: a seeded shuffle dealt out by size."""
    order = list(range(total))
    random.Random(seed).shuffle(order)
    assignment = bytearray(total)
    start = 0
    for index, size in enumerate(split_sizes(total, fractions)):
        for record in order[start : start + size]:
            assignment[record] = index
        start += size
    return assignment


def parse_splits(values: Sequence[Sequence[str]] | None) -> list[Split]:
    splits = []
    for name, fraction, output in values or ():
        if name not in SPLIT_NAMES:
            raise ConvertError(f"--split {name}: not one of {', '.join(SPLIT_NAMES)}")
        try:
            number = float(fraction)
        except ValueError:
            raise ConvertError(f"--split {name} {fraction}: not a number") from None
        if not 0 < number <= 1:
            raise ConvertError(f"--split {name} {fraction}: give a fraction in (0, 1]")
        splits.append(Split(name, number, Path(output)))
    names = [split.name for split in splits]
    if len(set(names)) != len(names):
        raise ConvertError("--split names a split twice")
    if splits and not math.isclose(sum(s.fraction for s in splits), 1.0, abs_tol=1e-6):
        raise ConvertError("--split fractions do not sum to 1")
    return splits


def convert_dolly(args: argparse.Namespace) -> int:
    source = Path(args.input)
    splits = parse_splits(args.split)
    if not splits and args.output is None:
        raise ConvertError("give --output, or --split NAME FRACTION OUTPUT for each split")
    if splits and args.output is not None:
        raise ConvertError("give --output or --split, not both")
    outputs = [s.output for s in splits] if splits else [Path(args.output)]
    named = ", ".join(str(path) for path in outputs)
    stats = ReadStats()
    if splits:
        # A first pass counts the good records: the shuffle deals out whole-record shares.
        total = sum(1 for _ in iter_dolly(source, stats))
        check_bad_fraction(stats, str(source), args.max_bad_fraction, named)
        assignment = assign_splits(total, [s.fraction for s in splits], args.seed)
    else:
        total, assignment = 0, bytearray()
    counts = [0] * len(outputs)
    with atomic_outputs(outputs) as files:
        seen = 0
        second = ReadStats() if splits else stats
        for seen, line in enumerate(iter_dolly(source, second), 1):
            index = assignment[seen - 1] if splits and seen <= total else 0
            files[index].write(line)
            counts[index] += 1
        if splits and seen != total:
            raise ConvertError(f"{source} changed while it was read; run the job again")
        if not splits:
            check_bad_fraction(stats, str(source), args.max_bad_fraction, named)
        if not seen:
            raise ConvertError(f"{source} has no usable record; {named} not written")
    for path, count in zip(outputs, counts, strict=True):
        if not count:
            print(f"warning: {path} has no records: the input is too small for its fraction")
    written = "; ".join(f"{count} to {path}" for path, count in zip(outputs, counts, strict=True))
    print(f"dolly: {source}: {seen} records written: {written}; {stats.bad} bad lines")
    return 0


# ---- command line ------------------------------------------------------------------------


def fraction(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 1")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sft_convert", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    formats = parser.add_subparsers(dest="format", required=True)
    squad = formats.add_parser("squad", help="a SQuAD v1.1 JSON file")
    squad.add_argument("--input", required=True, help="the SQuAD JSON file (.json or .json.gz)")
    squad.add_argument("--output", help="the JSON-lines file to write")
    squad.add_argument(
        "--text-to-text",
        nargs=2,
        metavar=("SRC", "TGT"),
        help="also (or only) write the inputs to SRC and their first answers to TGT, line by "
        "line (T5's and mT5's fine-tuning data)",
    )
    squad.add_argument(
        "--all-answers",
        action="store_true",
        help="also write original_answers, every answer's text (for evaluation sets)",
    )
    prompt = formats.add_parser(
        "squad-prompt", help="a SQuAD v1.1 JSON file as prompt-learning records"
    )
    prompt.add_argument("--input", required=True, help="the SQuAD JSON file (.json or .json.gz)")
    prompt.add_argument("--output", required=True, help="the JSON-lines file to write")
    prompt.add_argument("--validation", help="write a seeded share of the records here instead")
    prompt.add_argument(
        "--validation-fraction", type=fraction, default=0.1, help="that share (default 0.1)"
    )
    prompt.add_argument("--seed", type=int, default=1234, help="the shuffle's seed")
    prompt.add_argument(
        "--all-answers",
        action="store_true",
        help="also write original_answers, every answer's text (for test sets)",
    )
    dolly = formats.add_parser("dolly", help="Dolly-style JSON lines")
    dolly.add_argument("--input", required=True, help="the JSON-lines file (.jsonl or .jsonl.gz)")
    dolly.add_argument("--output", help="the JSON-lines file to write, when not splitting")
    dolly.add_argument(
        "--split",
        nargs=3,
        action="append",
        metavar=("NAME", "FRACTION", "OUTPUT"),
        help=f"write FRACTION of the records to OUTPUT; NAME is one of {', '.join(SPLIT_NAMES)}",
    )
    dolly.add_argument("--seed", type=int, default=1234, help="the shuffle's seed for --split")
    for sub in (squad, prompt, dolly):
        sub.add_argument(
            "--max-bad-fraction",
            type=fraction,
            default=0.01,
            help="fail if more than this fraction of the records are bad (default 0.01)",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        converters = {
            "squad": convert_squad,
            "squad-prompt": convert_squad_prompt,
            "dolly": convert_dolly,
        }
        return converters[args.format](args)
    except ConvertError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
