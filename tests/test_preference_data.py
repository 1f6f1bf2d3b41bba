"""How preference pairs become samples (jobs/fine_tuning/preference_data.py), on the shipped
corpus's real tokenizer: chat prompts through a chat template or as role lines, answers cut to
the sequence and counted, a prompt with no room refused with its line, the indexed layout's
pairs with their shared start as the prompt, and samples that keep pairs whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from launcher_scripts.jobs.fine_tuning.preference_data import (
    Counts,
    EvalPairs,
    PairSamples,
    chat_template,
    load_pairs,
    prompt_text,
    read_indexed,
    scored_sample,
)
from launcher_scripts.jobs.fine_tuning.sft_data import SftDataError
from launcher_scripts.jobs.inference.text_tokenizer import load_text_tokenizer

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "When does it rain?"},
]
# A template in the manner of the chat models' tokenizer_config.json.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(prepared: Path) -> Any:
    model = prepared / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.model"
    return load_text_tokenizer(OmegaConf.create({"model": str(model)}))


def test_chat_prompts_use_the_template_or_role_lines(tmp_path: Path) -> None:
    assert prompt_text(TURNS, TEMPLATE) == (
        "<|system|>Be brief.\n<|user|>When does it rain?\n<|assistant|>"
    )
    assert prompt_text(TURNS, None) == "system: Be brief.\nuser: When does it rain?\nassistant:"
    assert prompt_text("plain text", TEMPLATE) == "plain text"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": TEMPLATE}))
    assert chat_template(OmegaConf.create({"hf_config": str(config)})) == TEMPLATE
    assert chat_template(OmegaConf.create({"model": "x.model"})) is None


def _write(path: Path, *records: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_answers_are_cut_to_the_sequence_and_counted(tokenizer: Any, tmp_path: Path) -> None:
    long = " ".join(["dawn"] * 80)
    data = _write(
        tmp_path / "pairs.jsonl",
        {"prompt": TURNS, "chosen": " noon.", "rejected": " dusk."},
        {"prompt": "A noun before", "chosen": long, "rejected": " dusk."},
    )
    pairs, report = load_pairs([data], tokenizer, None, 48, "training data", generative=True)
    assert (
        report == "training data: 2 preference pairs (1 with an answer cut to the sequence length)"
    )
    first, second = pairs
    assert first.prompt == tokenizer.encode(prompt_text(TURNS, None))
    assert first.chosen == [*tokenizer.encode(" noon."), tokenizer.eod_id]  # DPO: ends with EOD
    assert len(second.prompt) + len(second.chosen) == 48 and second.rejected[-1] == tokenizer.eod_id
    scored, _ = load_pairs([data], tokenizer, None, 48, "training data")
    assert scored[0].chosen == tokenizer.encode(" noon.")  # a reward model's: no EOD


def test_a_prompt_with_no_room_names_its_line(tokenizer: Any, tmp_path: Path) -> None:
    data = _write(
        tmp_path / "pairs.jsonl",
        {"prompt": "short", "chosen": " a", "rejected": " b"},
        {"prompt": " ".join(["before"] * 40), "chosen": " a", "rejected": " b"},
    )
    with pytest.raises(
        SftDataError, match=rf"{data}:2: the prompt is \d+ tokens and the sequence 16"
    ):
        load_pairs([data], tokenizer, None, 16, "training data")


def _indexed(prefix: Path, documents: list[list[int]]) -> Path:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for document in documents:
        builder.add_document(torch.tensor(document, dtype=torch.int32), [len(document)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_indexed_pairs_share_their_prompt(tmp_path: Path) -> None:
    eod = 3
    prefix = _indexed(tmp_path / "pairs", [[7, 8, 9, 10, eod], [7, 8, 11, eod]])
    (scored,) = read_indexed(prefix, eod, 64, Counts())
    assert (scored.prompt, scored.chosen, scored.rejected) == ([], [7, 8, 9, 10], [7, 8, 11])
    (split,) = read_indexed(prefix, eod, 64, Counts(), split_prompt=True)
    assert (split.prompt, split.chosen, split.rejected) == ([7, 8], [9, 10, eod], [11, eod])
    odd = _indexed(tmp_path / "odd", [[7, eod], [8, eod], [9, eod]])
    with pytest.raises(SftDataError, match="3 documents: pairs need an even count"):
        list(read_indexed(odd, eod, 64, Counts()))
    prefix_only = _indexed(tmp_path / "start", [[7, 8, eod], [7, 8, eod, 9, eod]])
    with pytest.raises(SftDataError, match="one document is the start of the other"):
        list(read_indexed(prefix_only, eod, 64, Counts(), split_prompt=True))


def test_samples_keep_pairs_whole_and_pad_evaluation(tokenizer: Any, tmp_path: Path) -> None:
    data = _write(
        tmp_path / "pairs.jsonl",
        *({"prompt": f"p{i}", "chosen": " yes", "rejected": " no"} for i in range(5)),
    )
    pairs, _ = load_pairs([data], tokenizer, None, 16, "training data")
    make = scored_sample(16, tokenizer.eod_id)
    train = PairSamples(pairs, 12, make, seed=1, shuffle=True)
    assert len(train) == 24
    for index in range(0, 24, 2):  # a chosen side, then the rejected side of the same pair
        chosen, rejected = train[index], train[index + 1]
        pair = pairs[train.pair_index(index // 2)]
        assert chosen["tokens"][: chosen["lengths"]].tolist() == pair.side(False)
        assert rejected["tokens"][: rejected["lengths"]].tolist() == pair.side(True)
    orders = [[train.pair_index(e * 5 + i) for i in range(5)] for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(5)) and orders[0] != orders[1]
    evaluation = EvalPairs(pairs, 4, make)
    assert (len(evaluation), evaluation.batches) == (12, 3)  # 10 samples, padded to 3 batches
    assert [int(evaluation[i]["lengths"] > 0) for i in range(12)] == [1] * 10 + [0, 0]
