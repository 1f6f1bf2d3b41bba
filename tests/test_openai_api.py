"""OpenAI's API on the serving front (jobs/export/openai_api.py), tested with OpenAI's own Python
client against a real server: completions and chat, plain and streamed, the model list, and bad
input named in OpenAI's error object."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai  # the [dev] extra: tested with OpenAI's own client
import pytest

from launcher_scripts.jobs.export import openai_api as api
from tests.support.triton import post, triton_server


@pytest.fixture(scope="module")
def client(exported: Path, triton_python: Path) -> Iterator[tuple[object, int]]:
    with triton_server(exported) as ports:
        yield openai.OpenAI(base_url=f"http://localhost:{ports[0]}/v1", api_key="unused"), ports[0]


def test_the_model_list_names_the_served_model(client: tuple) -> None:
    assert [model.id for model in client[0].models.list()] == ["gpt3_tiny"]


def test_a_greedy_completion_is_triton_s_generate(client: tuple) -> None:
    openai_client, port = client
    done = openai_client.completions.create(
        model="gpt3_tiny", prompt="The history of", max_tokens=12, temperature=0
    )
    status, answer = post(
        port,
        "/v2/models/gpt3_tiny/generate",
        {"text_input": "The history of", "tokens_to_generate": 12, "top_k": 1},
    )
    assert status == 200
    assert done.choices[0].text == answer["text_output"]
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.completion_tokens > 0 and done.usage.prompt_tokens > 0
    streamed = openai_client.completions.create(
        model="gpt3_tiny", prompt="The history of", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == answer["text_output"]


def test_several_prompts_answer_in_order(client: tuple) -> None:
    prompts = ["The history of", "We like"]
    done = client[0].completions.create(
        model="gpt3_tiny", prompt=prompts, max_tokens=6, temperature=0
    )
    alone = [
        client[0].completions.create(model="gpt3_tiny", prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    assert [c.text for c in done.choices] == [a.choices[0].text for a in alone]


def test_a_chat_answers_as_the_assistant_plain_and_streamed(client: tuple) -> None:
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is near the river?"},
    ]
    done = client[0].chat.completions.create(
        model="gpt3_tiny", messages=messages, max_tokens=10, temperature=0
    )
    message = done.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert "\nUser:" not in message.content
    streamed = client[0].chat.completions.create(
        model="gpt3_tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in streamed]
    assert "".join(pieces) == message.content


def test_bad_input_is_openai_s_error_naming_the_field(client: tuple) -> None:
    chat = client[0].chat.completions
    with pytest.raises(openai.NotFoundError, match="'gpt4' is not served here: gpt3_tiny"):
        chat.create(model="gpt4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="n: 2 is not supported"):
        chat.create(model="gpt3_tiny", messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role: 'robot'"):
        chat.create(model="gpt3_tiny", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_p: 3"):
        client[0].completions.create(model="gpt3_tiny", prompt="A", top_p=3)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client[0].completions.create(model="gpt3_tiny", prompt="A", max_tokens=100000)
    # The server is still up.
    assert client[0].completions.create(model="gpt3_tiny", prompt="A", max_tokens=2).choices


def test_the_chat_prompt_is_the_fine_tuning_chat_format() -> None:
    prompt = api.chat_prompt(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        ]
    )
    assert prompt == "Be brief.\nUser: Hi\nAssistant: Hello\nUser: Why?\nAssistant: "
    request, stream = api.model_server_request(
        "chat", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stop": "."}
    )
    assert stream is False
    assert request["params"]["top_k"] == 1 and request["params"]["stop_words"] == [".", "\nUser:"]
    with pytest.raises(api.ApiError, match="unknown_thing is not a parameter"):
        api.model_server_request("completions", {"prompt": "A", "unknown_thing": 1})
