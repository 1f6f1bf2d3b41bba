"""Convert public preference datasets into the preference JSON-lines format that reward-model
training and direct preference optimisation read: one JSON object per line,

    {"prompt": PROMPT, "chosen": "the preferred answer", "rejected": "the other answer"}

where PROMPT is a text, or a conversation: a list of {"role": "system" | "user" | "assistant",
"content": text} ending with a user turn (the tuning stage applies the model's chat template).

    python3 -m launcher_scripts.jobs.data_prep.preference_convert hh-rlhf \\
        --input train.jsonl.gz --output hh_train.jsonl
    python3 -m launcher_scripts.jobs.data_prep.preference_convert ultrafeedback \\
        --input train_prefs.jsonl --output uf_train.jsonl
    python3 -m launcher_scripts.jobs.data_prep.preference_convert stack-exchange \\
        --input questions.jsonl --output se_train.jsonl [--max-pairs 1]

hh-rlhf (Anthropic's helpful-harmless): {"chosen": CONVERSATION, "rejected": CONVERSATION},
each a text of "\\n\\nHuman: ..." and "\\n\\nAssistant: ..." turns. The two must share every
turn before the last answer: those turns are the prompt; the last answers are chosen and
rejected.

ultrafeedback (UltraFeedback binarised): {"prompt": text, "chosen": MESSAGES, "rejected":
MESSAGES, "score_chosen", "score_rejected"}, each MESSAGES the whole conversation ending with
the assistant's answer. The turns before the answers must agree: they are the prompt. The
scores are kept when they are numbers.

stack-exchange (Stack Exchange preferences): {"question": text, "answers": [{"text": text,
"pm_score": number}, ...]}. The best-scored answer is chosen against the lowest-scored ones
(up to --max-pairs pairs per question, each rejected answer scored strictly lower); a question
without two answers of different scores makes no pair and is counted as skipped.

A record that cannot be converted, or whose chosen and rejected answers are the same text,
never stops the read: bad records are counted and the first few reported with file and line;
the job fails if more than --max-bad-fraction of them are bad. The output is written under a
temporary name and renamed into place only when the whole conversion succeeded. Exit status:
0 done, 1 failed (told in one line).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.formats.preference import conversation_problem, is_text, preference_problem
from launcher_scripts.jobs.data_prep.readers import ReadStats
from launcher_scripts.jobs.data_prep.sft_convert import (
    ConvertError,
    atomic_outputs,
    check_bad_fraction,
    encode,
    fraction,
    iter_converted,
)

HH_TURN = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def pair_line(prompt: Any, chosen: str, rejected: str, **extra: Any) -> bytes | str:
    """The output line of one pair, or why it is bad."""
    record = {"prompt": prompt, "chosen": chosen.strip(), "rejected": rejected.strip(), **extra}
    return preference_problem(record) or encode(record)


# ---- Anthropic HH-RLHF -------------------------------------------------------------------


def hh_turns(text: str) -> list[dict[str, str]] | str:
    """A "\\n\\nHuman: ...\\n\\nAssistant: ..." conversation as turns, or why it is not one."""
    parts = HH_TURN.split(text)
    if parts[0].strip():
        return "text before the first Human or Assistant turn"
    turns = [
        {"role": HH_ROLES[speaker], "content": content.strip()}
        for speaker, content in zip(parts[1::2], parts[2::2], strict=True)
    ]
    return turns or "no Human or Assistant turn"


def hh_line(record: Any) -> bytes | str:
    if not isinstance(record, dict):
        return "not a JSON object"
    sides = []
    for name in ("chosen", "rejected"):
        if not is_text(record.get(name)):
            return f"'{name}' missing or not a non-blank text"
        turns = hh_turns(record[name])
        if isinstance(turns, str):
            return f"'{name}': {turns}"
        if turns[-1]["role"] != "assistant":
            return f"'{name}' does not end with an Assistant turn"
        sides.append(turns)
    chosen, rejected = sides
    if chosen[:-1] != rejected[:-1]:
        return "'chosen' and 'rejected' differ before their last Assistant turn"
    return pair_line(chosen[:-1], chosen[-1]["content"], rejected[-1]["content"])


# ---- UltraFeedback binarised -------------------------------------------------------------


def ultrafeedback_line(record: Any) -> bytes | str:
    if not isinstance(record, dict):
        return "not a JSON object"
    sides = []
    for name in ("chosen", "rejected"):
        turns = record.get(name)
        if not isinstance(turns, list):
            return f"'{name}' missing or not a list of turns"
        problem = conversation_problem(turns, name)
        if problem:
            return problem
        if turns[-1]["role"] != "assistant":
            return f"'{name}' does not end with an assistant turn"
        sides.append(turns)
    chosen, rejected = sides
    prompt = [{"role": t["role"], "content": t["content"]} for t in chosen[:-1]]
    if prompt != [{"role": t["role"], "content": t["content"]} for t in rejected[:-1]]:
        return "'chosen' and 'rejected' differ before their answers"
    if not prompt:  # the answers alone: the prompt field is the question
        if not is_text(record.get("prompt")):
            return "no turns before the answers and no 'prompt' text"
        prompt = [{"role": "user", "content": record["prompt"]}]
    scores = {
        name: record[name]
        for name in ("score_chosen", "score_rejected")
        if isinstance(record.get(name), int | float) and not isinstance(record.get(name), bool)
    }
    return pair_line(prompt, chosen[-1]["content"], rejected[-1]["content"], **scores)


# ---- Stack Exchange preferences ----------------------------------------------------------


@dataclass
class StackExchange:
    max_pairs: int
    skipped: int = 0  # questions without two answers of different scores

    def lines(self, record: Any) -> list[bytes] | str:
        if not isinstance(record, dict):
            return "not a JSON object"
        if not is_text(record.get("question")):
            return "'question' missing or not a non-blank text"
        answers = record.get("answers")
        if not isinstance(answers, list):
            return "'answers' missing or not a list"
        scored = []
        for index, answer in enumerate(answers):
            score = answer.get("pm_score") if isinstance(answer, dict) else None
            if not isinstance(score, int | float) or isinstance(score, bool):
                return f"answers[{index}].pm_score missing or not a number"
            if not is_text(answer.get("text")):
                return f"answers[{index}].text missing or blank"
            scored.append((score, answer["text"]))
        scored.sort(key=lambda item: item[0], reverse=True)
        best_score, best = scored[0] if scored else (0, "")
        lower = [item for item in reversed(scored) if item[0] < best_score]
        lines = []
        for score, text in lower[: self.max_pairs]:
            line = pair_line(
                record["question"], best, text, score_chosen=best_score, score_rejected=score
            )
            if isinstance(line, bytes):  # an answer posted twice is no preference
                lines.append(line)
        if not lines:
            self.skipped += 1
        return lines


# ---- command line ------------------------------------------------------------------------


def convert(source: Path, output: Path, line_of: Callable[[Any], Any], limit: float) -> int:
    stats = ReadStats()
    written = 0
    with atomic_outputs([output]) as (out,):
        for line in iter_converted(source, stats, line_of):
            out.write(line)
            written += 1
        check_bad_fraction(stats, str(source), limit, str(output))
        if not written:
            raise ConvertError(f"{source} has no usable record; {output} not written")
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preference_convert", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    formats = parser.add_subparsers(dest="format", required=True)
    helps = {
        "hh-rlhf": "Anthropic HH-RLHF: chosen and rejected conversations",
        "ultrafeedback": "UltraFeedback binarised: chosen and rejected message lists",
        "stack-exchange": "Stack Exchange preferences: a question and scored answers",
    }
    for name, text in helps.items():
        sub = formats.add_parser(name, help=text)
        sub.add_argument("--input", required=True, help="the JSON-lines file (.jsonl, .jsonl.gz)")
        sub.add_argument("--output", required=True, help="the preference JSON-lines file")
        sub.add_argument(
            "--max-bad-fraction",
            type=fraction,
            default=0.01,
            help="fail if more than this fraction of the records are bad (default 0.01)",
        )
        if name == "stack-exchange":
            sub.add_argument(
                "--max-pairs",
                type=int,
                default=1,
                help="pairs per question: the best answer against this many of the lowest "
                "scored (default 1)",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    source, output = Path(args.input), Path(args.output)
    try:
        if output.resolve() == source.resolve():
            raise ConvertError("--output must not overwrite --input: choose another path")
        stack = None
        if args.format == "hh-rlhf":
            line_of: Callable[[Any], Any] = hh_line
        elif args.format == "ultrafeedback":
            line_of = ultrafeedback_line
        else:
            if args.max_pairs < 1:
                raise ConvertError(f"--max-pairs {args.max_pairs}: give 1 or more")
            stack = StackExchange(args.max_pairs)
            line_of = stack.lines
        written = convert(source, output, line_of, args.max_bad_fraction)
    except ConvertError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    skipped = f"; {stack.skipped} questions without a pair" if stack else ""
    print(f"{args.format}: {source}: {written} preference pairs written to {output}{skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
