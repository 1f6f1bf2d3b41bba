"""The generation engine: its sampling math against transformers' logits processors, its text
handling on a scripted byte-level model, and decoding on the real tiny model (in a subprocess,
since torch.distributed starts once per process)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher_scripts.jobs.inference.generation import (
    GenerationParams,
    apply_repetition_penalty,
    apply_temperature,
    filter_logits,
    generate,
    stream,
    top_k_filter,
    top_p_filter,
)
from tests.support.commands import module_report

# ---------------------------------------------------------------------------------------------
# GenerationParams


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tokens_to_generate", 0, "tokens_to_generate: 0 is not allowed; "),
        ("temperature", -0.5, "temperature: -0.5 is not allowed; "),
        ("temperature", float("nan"), "temperature: nan is not allowed; "),
        ("top_k", 2.5, "top_k: 2.5 is not allowed; "),
        ("top_p", 1.5, "top_p: 1.5 is not allowed; expected a number in [0, 1]"),
        ("repetition_penalty", 0.0, "repetition_penalty: 0.0 is not allowed"),
        ("random_seed", -1, "random_seed: -1 is not allowed; "),
        ("stop_words", "END", "stop_words: 'END' is not allowed; expected a list"),
        ("stop_words", ("",), "stop_words: ('',) is not allowed; "),
        ("beam_width", 0, "beam_width: 0 is not allowed; "),
        ("length_penalty", float("inf"), "length_penalty: inf is not allowed"),
    ],
)
def test_params_check_names_the_field_the_value_and_the_range(
    field: str, value: Any, expected: str
) -> None:
    with pytest.raises(ValueError) as raised:
        GenerationParams(**{field: value}).check()
    message = str(raised.value)
    assert message.startswith(expected), message
    assert "\n" not in message and "expected " in message


def test_default_params_are_valid_and_greedy_follows_nemo() -> None:
    GenerationParams().check()
    GenerationParams(stop_words=("\n", "END"), random_seed=0, beam_width=4).check()
    assert GenerationParams(top_k=1).greedy
    assert GenerationParams(temperature=0).greedy
    assert not GenerationParams(top_k=2, temperature=0.7).greedy


# ---------------------------------------------------------------------------------------------
# Sampling math = transformers' processors


def random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 64, generator=generator) * 3
    seen = torch.randint(0, 64, (4, 20), generator=generator)
    return logits, seen


@pytest.mark.parametrize("seed", range(5))
def test_sampling_math_matches_transformers(seed: int) -> None:
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits, seen = random_case(seed)
    ids = seen.tolist()
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, ids, 1.3), theirs)
    theirs = TemperatureLogitsWarper(0.7)(seen, logits.clone())
    assert torch.allclose(apply_temperature(logits, 0.7), theirs)
    for k in (1, 5, 63, 64):
        assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(seen, logits.clone()))
    for p in (0.05, 0.5, 0.9, 0.99):
        assert torch.equal(top_p_filter(logits, p), TopPLogitsWarper(p)(seen, logits.clone()))

    params = GenerationParams(repetition_penalty=1.2, temperature=0.8, top_k=20, top_p=0.8)
    pipeline = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.2),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(20),
            TopPLogitsWarper(0.8),
        ]
    )
    ours, theirs = filter_logits(logits, ids, params), pipeline(seen, logits.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.allclose(ours[~ours.isinf()], theirs[~theirs.isinf()])


def test_disabled_filters_keep_everything() -> None:
    logits, seen = random_case(0)
    assert torch.equal(filter_logits(logits, seen.tolist(), GenerationParams()), logits)
    assert torch.equal(top_p_filter(logits, 1.0), logits)


# ---------------------------------------------------------------------------------------------
# Text handling, on a scripted byte-level model: the model writes SCRIPT after its prompt.


class ByteTokenizer:
    """Token = byte + 1, 0 = eod: a multi-byte character spans tokens, as with byte fallback."""

    vocab_size = 257
    eod_id = 0

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 1 for i in ids if i).decode(errors="replace")


class ScriptedModel:
    """Next-token logits that continue `script` after its first byte; eod after its end. Logs
    the batch size of each call."""

    def __init__(self, script: str) -> None:
        self.tokens = ByteTokenizer().encode(script) + [0]
        self.batches: list[int] = []

    def __call__(self, batch: list[list[int]]) -> torch.Tensor:
        self.batches.append(len(batch))
        width = max(len(row) for row in batch)
        logits = torch.zeros(len(batch), width, 257)
        for position in range(width):
            logits[:, position, self.tokens[min(position + 1, len(self.tokens) - 1)]] = 10.0
        return logits


SCRIPT = "xthe café is open; the end"


def scripted(prompts: list[str], params: GenerationParams, model: ScriptedModel | None = None):
    model = model or ScriptedModel(SCRIPT)
    return generate(model, ByteTokenizer(), prompts, params, max_length=64)


def test_eod_stop_words_and_length_finish_a_scripted_continuation() -> None:
    greedy = GenerationParams(tokens_to_generate=40, top_k=1)
    (done,) = scripted(["x"], greedy)
    assert (done.text, done.finish_reason) == ("the café is open; the end", "eod")
    assert done.tokens == ByteTokenizer().encode(done.text)

    (stopped,) = scripted(["x"], GenerationParams(top_k=1, stop_words=("open", "is o")))
    assert (stopped.text, stopped.finish_reason) == ("the café ", "stop")
    assert stopped.tokens == ByteTokenizer().encode("the café ")

    (cut,) = scripted(["x"], GenerationParams(tokens_to_generate=3, top_k=1))
    assert (cut.text, cut.tokens, cut.finish_reason) == ("the", [117, 105, 102], "length")


def test_finished_rows_leave_the_batch() -> None:
    model = ScriptedModel(SCRIPT)
    long_prompt = SCRIPT[: len(SCRIPT) - 3]
    completions = scripted(["x", long_prompt], GenerationParams(top_k=1), model)
    assert [c.text for c in completions] == ["the café is open; the end", "end"]
    assert model.batches[:4] == [2, 2, 2, 2] and set(model.batches[4:]) == {1}


@pytest.mark.parametrize(
    "stop_words",
    [(), ("the end",), ("open;", "ca"), ("é is",), ("nowhere", "the café!")],
)
def test_stream_joins_to_generate_and_never_sends_a_stop_word_start(
    stop_words: tuple[str, ...],
) -> None:
    params = GenerationParams(top_k=1, stop_words=stop_words)
    pieces = list(stream(ScriptedModel(SCRIPT), ByteTokenizer(), "x", params, max_length=64))
    assert "".join(pieces) == scripted(["x"], params)[0].text
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(pieces) > 1


def test_stream_sends_text_once_it_cannot_become_a_stop_word_or_a_character() -> None:
    params = GenerationParams(top_k=1, stop_words=("the end",))
    pieces = list(stream(ScriptedModel(SCRIPT), ByteTokenizer(), "x", params, max_length=64))
    # "the " could start "the end" until the "c"; "é" waits for its second byte.
    assert pieces[:5] == ["the c", "a", "f", "é", " "]
    assert "".join(pieces) == "the café is open; "


def test_stream_refuses_beam_search() -> None:
    with pytest.raises(ValueError, match="beam_width: 3 cannot stream"):
        list(
            stream(
                ScriptedModel(SCRIPT),
                ByteTokenizer(),
                "x",
                GenerationParams(beam_width=3),
                max_length=64,
            )
        )


# ---------------------------------------------------------------------------------------------
# The real tiny model


@pytest.fixture(scope="module")
def report(tiny_portable: Path) -> dict[str, Any]:
    return module_report("tests.scripts.generation_check", str(tiny_portable))


def test_greedy_is_the_argmax_loop(report: dict[str, Any]) -> None:
    greedy = report["greedy"]
    assert [c["tokens"] for c in greedy["one_at_a_time"]] == greedy["reference"]
    assert greedy["temperature_0"] == greedy["one_at_a_time"]
    assert greedy["beam_width_1"] == greedy["one_at_a_time"]
    for completion in greedy["one_at_a_time"]:
        assert completion["text"].strip()
        done = len(completion["tokens"]) == 24
        assert completion["finish_reason"] == ("length" if done else "eod")


def test_a_batch_of_prompts_matches_one_at_a_time(report: dict[str, Any]) -> None:
    assert report["greedy"]["batched"] == report["greedy"]["one_at_a_time"]
    assert report["greedy"]["beam_batched"] == report["greedy"]["beam_one_at_a_time"]


def test_a_seed_repeats_its_sample_and_another_seed_differs(report: dict[str, Any]) -> None:
    first, again, other = report["sampling"]["seeded"]
    assert first == again
    assert first["text"] != other["text"]


def test_top_k_sampling_draws_only_from_the_top_k(report: dict[str, Any]) -> None:
    ranks = report["sampling"]["top5_ranks"]
    assert ranks and max(ranks) < 5
    assert max(ranks) > 0  # it did sample, not only take the argmax


def test_stream_joins_to_the_generated_text(report: dict[str, Any]) -> None:
    greedy = report["greedy"]
    for pieces, completion in zip(greedy["streamed"], greedy["one_at_a_time"], strict=True):
        assert "".join(pieces) == completion["text"]
        assert len(pieces) > 1
    assert "".join(report["sampling"]["streamed"]) == report["sampling"]["seeded"][0]["text"]


def test_a_stop_word_cuts_the_text_and_its_tokens(report: dict[str, Any]) -> None:
    stop = report["stop"]
    greedy, word, stopped = stop["greedy"], stop["word"], stop["stopped"]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == greedy["text"][: greedy["text"].index(word)]
    # The tokens are greedy's up to the last one whose text fits before the stop word.
    assert stopped["tokens"] == greedy["tokens"][: len(stopped["tokens"])]
    assert stopped["text"].startswith(stop["kept_text"])
    assert not stopped["text"].startswith(stop["next_text"])
    assert "".join(stop["streamed"]) == stopped["text"]
    assert word not in stop["beam"]["text"]


def test_beam_search_finds_the_exhaustive_optimum(report: dict[str, Any]) -> None:
    cases = report["beam"]
    for case in cases:
        assert case["found"] == case["expected"], case


def test_too_long_and_empty_prompts_are_one_line_errors(report: dict[str, Any]) -> None:
    errors, n = report["errors"], report["errors"]["prompt_tokens"]
    expected = (
        f"prompt is {n} tokens; {n} + tokens_to_generate 24 exceeds the model's "
        f"{report['max_length']} positions: shorten the prompt or lower tokens_to_generate"
    )
    assert errors["too_long"] == expected
    assert errors["too_long_stream"] == expected
    assert errors["empty"] == "prompt 1 is empty: give some text to continue"
    assert errors["beam_stream"].startswith("beam_width: 2 cannot stream")


class MarkovModel:
    """Next-token probabilities given the last token alone (a table of characters; eod is
    "$"), every other token at a negligible logit."""

    def __init__(self, table: dict[str, dict[str, float]]) -> None:
        self.table = table

    def __call__(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in batch)
        logits = torch.full((len(batch), width, 257), -40.0)
        for index, row in enumerate(batch):
            for position, token in enumerate(row):
                following = self.table.get(ByteTokenizer().decode([token]), {})
                for char, probability in following.items():
                    column = 0 if char == "$" else ByteTokenizer().encode(char)[0]
                    logits[index, position, column] = math.log(probability)
        return logits


def beam(model: MarkovModel, **params: object) -> str:
    settings = GenerationParams(tokens_to_generate=3, beam_width=2, **params)
    return generate(model, ByteTokenizer(), ["p"], settings, max_length=64)[0].text


def test_a_larger_length_penalty_prefers_the_shorter_candidate() -> None:
    """inference-reference.md: 'Larger values penalize long candidates more heavily thus
    preferring shorter candidates.' Here "" scores log .3 x 1^p, "a" log .7 x 2^p."""
    model = MarkovModel({"p": {"$": 0.3, "a": 0.7}, "a": {"$": 1.0}})
    assert beam(model, length_penalty=0.0) == "a"
    assert beam(model, length_penalty=3.0) == ""


def test_the_diversity_rate_lets_another_parents_beam_survive() -> None:
    """inference-reference.md: 'A higher value encourages beam search to return a more diverse
    set of candidates.' Two beams; the first has two good continuations, the second one weaker:
    without the rate both survivors are the first beam's children, with it each continuation of
    a beam loses rate x its rank among its siblings and the second beam's best survives."""
    from launcher_scripts.jobs.inference.generation import _beam_step, _Beams, _Prompt

    logits = torch.full((2, 257), -50.0)
    logits[0, 98], logits[0, 99] = 0.0, -0.1  # "a" then "b" after the first beam
    logits[1, 100] = 0.0  # "c" after the second, which starts 1.5 lower

    def survivors(rate: float) -> list[tuple[str, int]]:
        search = _Beams(_Prompt([113], "p"))
        search.live = [([120], 0.0, 0), ([121], -1.5, 1)]
        params = GenerationParams(tokens_to_generate=8, beam_width=2)
        params = dataclasses.replace(params, beam_search_diversity_rate=rate)
        _beam_step(search, logits, ByteTokenizer(), params)
        return [(ByteTokenizer().decode(ids), parent) for ids, _, parent in search.live]

    assert survivors(0.0) == [("wa", 0), ("wb", 0)]
    assert survivors(2.0) == [("wa", 0), ("xc", 1)]
