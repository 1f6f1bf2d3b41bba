"""A T5 exported to Triton and served for real: the same request inputs as a GPT's, answered
as in-process seq2seq generation answers them (greedy, beam search, sampling, stop words,
streaming), and bad requests refused with a 400 that says what to change.

The model is the session's briefly pretrained tiny T5 (conftest's t5_converted): what it says
does not matter here, only that the server says the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.commands import run_main
from tests.support.triton import post, serves_like_in_process, triton_server

PROMPTS = [
    "question: what is the history of the city? context: the city was founded by the king",
    "the river runs through the old town",
    "translate: in the morning the village was quiet",
]
MODEL = "t5_tiny"


@pytest.fixture(scope="module")
def t5_export(t5_converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    results = tmp_path_factory.mktemp("t5_export")
    result = run_main(
        "stages=[export]",
        "export=t5/export_t5",
        f"export.run.model_train_name={MODEL}",
        f"base_results_dir={results}",
        f"export.model.nemo_file={t5_model(t5_converted)}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results / MODEL / "export"


def t5_model(t5_converted: Path) -> Path:
    return t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"


@pytest.fixture(scope="module")
def t5_server(t5_export: Path, triton_python: Path) -> Iterator[tuple[int, int]]:
    with triton_server(t5_export) as ports:
        yield ports


def test_the_export_checked_that_the_t5_answers(t5_export: Path) -> None:
    repository = t5_export / "model_repo"
    assert sorted(p.name for p in repository.iterdir()) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        MODEL,
        f"{MODEL}_stream",
        f"{MODEL}_tokens",
    ]
    check = json.loads((t5_export / "check.json").read_text())
    assert check["prompt"].startswith("question:")
    assert check["finish_reason"] in ("length", "stop", "eod")


def test_triton_serves_the_t5_as_in_process_generation_does(
    t5_server: tuple[int, int], triton_python: Path, t5_converted: Path, tmp_path: Path
) -> None:
    served, _greedy = serves_like_in_process(
        triton_python, MODEL, t5_server, t5_model(t5_converted), PROMPTS, tmp_path
    )
    errors = served["errors"]
    assert "text_input is required" in errors["missing_text"]
    assert (
        "tokens_to_generate is 100000: more than the decoder's 128 positions. Lower it"
        in (errors["too_many_tokens"])
    )
    assert "top_p" in errors["bad_top_p"]
    assert "beam_width" in errors["stream_beam"]


def test_the_t5_s_ensemble_answers_as_its_text_model(t5_server: tuple[int, int]) -> None:
    """The ensemble on an encoder-decoder: the prompt's ids go to the encoder, the generated
    ids come back as the text model's text."""
    port = t5_server[0]
    body = {"text_input": PROMPTS[0], "tokens_to_generate": 8, "top_k": 1}
    status, plain = post(port, f"/v2/models/{MODEL}/generate", body)
    assert status == 200, plain
    status, chained = post(port, "/v2/models/ensemble/generate", body)
    assert status == 200, chained
    assert chained["text_output"] == plain["text_output"]
    assert chained["sequence_length"] == len(chained["output_ids"])


def test_a_prompt_longer_than_the_encoder_is_refused_not_cut(t5_server: tuple[int, int]) -> None:
    port = t5_server[0]
    generate = f"/v2/models/{MODEL}/generate"
    long_prompt = " ".join(["the"] * 200)  # a token each
    for path in (generate, f"/v2/models/{MODEL}_stream/generate_stream"):
        status, answer = post(port, path, {"text_input": long_prompt, "tokens_to_generate": 4})
        assert status == 400, answer
        assert answer["error"] == (
            "the prompt is 200 tokens: with its end token more than the encoder's 128 "
            "positions. Shorten the prompt"
        )
    status, answer = post(port, generate, {"text_input": PROMPTS[1], "tokens_to_generate": 4})
    assert status == 200 and answer["text_output"], answer
