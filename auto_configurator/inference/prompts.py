"""The benchmark's prompts: plain English text of exactly `input_len` tokens of the model's own
tokenizer, one different prompt per row, the same prompts on every measuring path.

The tokenizer comes out of the portable file (its tokenizer/ members only, not the weights).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

from launcher_scripts.errors import LauncherError
from launcher_scripts.jobs.inference.text_tokenizer import TextTokenizer, load_text_tokenizer

SOURCE = (
    "The history of the river towns begins with the mills that were built along the water in "
    "the early years of the century. Farmers brought grain from the hills, and the merchants "
    "who bought it sent flour down the river to the cities on the coast. When the railway "
    "arrived, the old roads fell quiet, but the towns grew around the stations, and schools, "
    "churches and markets followed. Many of the families who live there today can trace their "
    "names back to the first settlers, whose letters and diaries describe long winters, "
    "floods in the spring, and the slow work of clearing the forest for fields and orchards."
)
# How far past input_len a cut may be moved to find text that encodes to input_len tokens.
SEARCH_WIDTH = 6


def load_tokenizer(model_file: Path, workdir: Path) -> TextTokenizer:
    """The model's tokenizer, its files extracted from the portable file into `workdir`."""
    from launcher_scripts.formats.portable import TOKENIZER_DIR, TOKENIZER_KEYS, read_config

    config = read_config(model_file)
    with tarfile.open(model_file) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"{TOKENIZER_DIR}/")]
        tar.extractall(workdir, members=members, filter="data")
    section = config.tokenizer
    for key in TOKENIZER_KEYS:
        value = section.get(key)
        if value:
            section[key] = str(workdir / str(value))
    return load_text_tokenizer(section)


def make_prompts(tokenizer: TextTokenizer, input_len: int, count: int) -> list[str]:
    """`count` prompts, each encoding to exactly `input_len` tokens."""
    words = SOURCE.split()
    prompts = []
    for row in range(count):
        start = (row * 7) % len(words)
        text = " ".join(words[start:] + words[:start])
        while len(tokenizer.encode(text)) < input_len + SEARCH_WIDTH:
            text = f"{text} {SOURCE}"
        prompts.append(_cut(tokenizer, text, input_len))
    return prompts


def _cut(tokenizer: TextTokenizer, text: str, input_len: int) -> str:
    """A prefix of `text` that encodes to `input_len` tokens. Decoding the first n ids and
    encoding the result again may merge pieces differently, so nearby cuts are tried too."""
    ids = tokenizer.encode(text)
    for offset in sorted(range(-SEARCH_WIDTH, SEARCH_WIDTH + 1), key=abs):
        size = input_len + offset
        if size < 1:
            continue
        candidate = tokenizer.decode(ids[:size])
        if len(tokenizer.encode(candidate)) == input_len:
            return candidate
    raise LauncherError(
        f"cannot make a prompt of exactly {input_len} tokens with the model's tokenizer: "
        "try another search_config.inference_settings.benchmark.input_len"
    )


def continuation_tokens(tokenizer: TextTokenizer, prompt: str, text: str) -> int:
    """How many tokens a served continuation holds, from its text: the prompt and the text
    encoded together, less the prompt's tokens (for rows that ended before output_len)."""
    return max(len(tokenizer.encode(prompt + text)) - len(tokenizer.encode(prompt)), 0)
