"""The model server (jobs/inference/model_server.py) on the tiny model: concurrent clients, some
of them malformed, all answered (the bad ones with a 400 naming the problem) while the server
stays up; a client that leaves mid-stream frees its slots; a TP=2 group answers as one process."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from launcher_scripts.jobs.inference.model_server import ask
from tests.support import REPO
from tests.support.commands import ONE_THREAD

GREEDY = {"tokens_to_generate": 12, "top_k": 1}
PROMPTS = ["The history of", "A", "In the morning the river was", "We like", "Every winter"]
BAD = {
    "not json": (b"{prompts", "the request is not JSON"),
    "misspelled": (
        {"prompts": ["A"], "params": {"tokens_to_generat": 4}},
        "params.tokens_to_generat is not a generation parameter (did you mean tokens_to_generate?)",
    ),
    "bad value": ({"prompts": ["A"], "params": {"top_p": 3}}, "params.top_p: 3 is not allowed"),
    "too long": (
        {"prompts": ["x " * 300], "params": {}},
        "together more than the model's 128 positions",
    ),
    "too many beams": (
        {"prompts": PROMPTS[:3], "params": {"beam_width": 3}},
        "need 9 sequences at once; this server holds 8",
    ),
    "no prompts": ({"params": {}}, "prompts: give a non-empty list of strings"),
    "not an id": (
        {"prompts": [[5, 8000]], "params": {}},
        "prompt: token id 8000 at position 1 is not an id of the model's tokenizer (0 to 7999)",
    ),
    "untokenizable": ({"tokenize": "A"}, "tokenize: give a list of strings"),
    "unpaired": (
        {"detokenize": [[5], [6]], "after": [[7]]},
        "after has 1 prompt(s) for 2 generated sequence(s)",
    ),
}


@contextlib.contextmanager
def model_server(model: Path, folder: Path, tensor: int = 1) -> Iterator[Path]:
    path = folder / f"tp{tensor}.sock"
    launcher = [sys.executable]
    if tensor > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tensor}"]
    command = [*launcher, "-m", "launcher_scripts.jobs.inference.model_server"]
    command += ["--model", str(model), "--socket", str(path), "--slots", "8", "--cpu"]
    command += ["--tensor", str(tensor)]
    log = (folder / f"tp{tensor}.log").open("w")
    server = subprocess.Popen(command, cwd=REPO, env=ONE_THREAD, stdout=log, stderr=log)
    try:
        for _ in range(1200):  # the model loads: up to two minutes
            if path.exists() or server.poll() is not None:
                break
            time.sleep(0.1)
        assert path.exists(), (folder / f"tp{tensor}.log").read_text()[-3000:]
        yield path
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def send_raw(path: Path, line: bytes) -> list[dict[str, Any]]:
    import json

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(path))
        connection.sendall(line + b"\n")
        with connection.makefile("rb") as answers:
            return [json.loads(answer) for answer in answers if answer.strip()]


def request(path: Path, message: Any) -> list[dict[str, Any]]:
    return send_raw(path, message) if isinstance(message, bytes) else ask(path, message)


@pytest.fixture(scope="module")
def served(tiny_portable: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with model_server(tiny_portable, tmp_path_factory.mktemp("model_server")) as path:
        yield path


def test_concurrent_clients_good_and_bad_are_all_answered(served: Path) -> None:
    """100 requests at once, 20 of them malformed or beyond the server's slots: every valid one
    gets what it gets alone, every bad one a 400 naming its problem, and the server stays up."""
    good = [{"prompts": [PROMPTS[i % 5]], "params": GREEDY} for i in range(80)]
    bad = [message for message, _ in BAD.values()]
    bad = [bad[i % len(bad)] for i in range(20)]
    messages = [good[i // 5 * 4 + i % 5] if i % 5 < 4 else bad[i // 5] for i in range(100)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda m: request(served, m), messages))
    alone = {json.dumps(m): ask(served, m) for m in good[:5]}  # on a quiet server
    assert sum(m in good for m in messages) == 80
    for message, answer in zip(messages, answers, strict=True):
        if message in good:
            assert answer == alone[json.dumps(message)] and "texts" in answer[0], answer
        else:
            expected = next(text for m, text in BAD.values() if m == message)
            assert answer[0]["status"] == 400 and expected in answer[0]["error"], answer
    assert ask(served, {"stats": True})[0]["live"] == 0  # still up, and nothing left behind


def test_a_stream_is_the_answer_in_pieces(served: Path) -> None:
    pieces = ask(served, {"prompts": [PROMPTS[0]], "params": GREEDY, "stream": True})
    whole = ask(served, {"prompts": [PROMPTS[0]], "params": GREEDY})[0]
    assert "".join(p["text"] for p in pieces[:-1]) == whole["texts"][0]
    assert pieces[-1] == {"finish_reason": whole["finish_reasons"][0], "done": True}


def test_prompts_as_token_ids_answer_as_their_text_and_decode_back(served: Path) -> None:
    """The ensemble's path: text -> ids (tokenize), generation on ids, ids -> text after the
    prompt (detokenize) gives the text model's answer."""
    ids = ask(served, {"tokenize": PROMPTS})[0]["ids"]
    on_text = ask(served, {"prompts": PROMPTS, "params": GREEDY})[0]
    on_ids = ask(served, {"prompts": ids, "params": GREEDY})[0]
    assert on_ids == on_text
    decoded = ask(served, {"detokenize": on_ids["tokens"], "after": ids})[0]["texts"]
    assert decoded == on_text["texts"]
    assert ask(served, {"detokenize": [[]]})[0]["texts"] == [""]


def test_a_client_that_leaves_mid_stream_frees_its_slots(served: Path) -> None:
    import json

    long = {"prompts": [PROMPTS[0]], "params": {"tokens_to_generate": 100, "top_k": 1}}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(served))
        connection.sendall(json.dumps({**long, "stream": True}).encode() + b"\n")
        assert connection.makefile("rb").readline()  # it is generating
    steps = ask(served, {"stats": True})[0]["steps"]
    for _ in range(600):  # cancelled within a step of the watcher noticing
        stats = ask(served, {"stats": True})[0]
        if stats["live"] == 0:
            break
        time.sleep(0.05)
    assert stats["live"] == 0, stats
    assert stats["steps"] - steps < 100  # it did not run to its end


def test_a_tp2_group_serves_what_one_process_serves(
    served: Path, tiny_portable: Path, tmp_path: Path
) -> None:
    messages = [
        {"prompts": PROMPTS[:2], "params": GREEDY},
        {"prompts": [PROMPTS[2]], "params": {"tokens_to_generate": 8, "beam_width": 3}},
        {
            "prompts": [PROMPTS[3]],
            "params": {"tokens_to_generate": 10, "top_k": 5, "random_seed": 3},
        },
    ]
    alone = [ask(served, message) for message in messages]
    with model_server(tiny_portable, tmp_path, tensor=2) as tp2, ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda m: ask(tp2, m), messages)) == alone


def test_more_slots_than_memory_holds_is_one_line_naming_what_fits(
    tiny_portable: Path, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "launcher_scripts.jobs.inference.model_server"]
    command += ["--model", str(tiny_portable), "--socket", str(tmp_path / "m.sock")]
    command += ["--slots", "100000000", "--cpu"]
    result = subprocess.run(command, cwd=REPO, env=ONE_THREAD, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--slots 100000000 needs about" in errors[0], result.stderr
    assert "of 128 tokens and their first pass" in errors[0] and "at most " in errors[0]
    assert not (tmp_path / "m.sock").exists()


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_the_cache_estimate_is_the_cache(
    family: str, tiny_portable: Path, t5_converted: Path
) -> None:
    """cache_bytes_per_slot (the memory check's) is what the cache allocates per slot: a
    decoder's keys and values; an encoder-decoder's decoder keys and values and its encoder's
    output."""
    model = tiny_portable
    if family == "t5":
        model = t5_converted / "t5_tiny" / "convert_nemo" / "megatron_t5.nemo"
    script = (
        "import sys; from pathlib import Path;"
        "from launcher_scripts.jobs.inference.served import open_served;"
        "d = open_served(Path(sys.argv[1]), on_gpu=False).decoding; c = d.cache(3, 40);"
        "print(c.bytes, 3 * d.cache_bytes_per_slot(40))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(model)],
        cwd=REPO, env=ONE_THREAD, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    allocated, estimated = map(int, result.stdout.split()[-2:])
    assert allocated == estimated > 0
