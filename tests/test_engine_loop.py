"""In-flight batching on the tiny model (jobs/inference/engine_loop.py): requests from several
threads get what each gets alone, requests released together share one step per token, a short
request that joins a long one answers first, a cancelled one stops and frees its slots, and a
request the cache can never hold is refused with the numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.commands import module_report


@pytest.fixture(scope="module")
def report(tiny_portable: Path) -> dict[str, Any]:
    return module_report("tests.scripts.engine_loop_check", str(tiny_portable))


def test_each_request_gets_what_it_gets_alone(report: dict[str, Any]) -> None:
    assert report["same_as_alone"] == [True, True, True, True]


def test_requests_released_together_share_one_step_per_token(report: dict[str, Any]) -> None:
    together = report["together"]
    # One at a time, eight requests of up to 24 tokens take up to 8 x 23 steps.
    assert together["steps"] == max(together["tokens"]) - 1, together


def test_a_short_request_joining_a_long_one_answers_first(report: dict[str, Any]) -> None:
    assert report["short_first"] is True


def test_a_cancelled_request_stops_and_frees_its_slots(report: dict[str, Any]) -> None:
    assert report["cancelled"] == "cancelled by its client"
    assert report["served_after_cancel"] is True
    assert report["live_after"] == 0


def test_a_request_too_large_for_the_cache_is_refused(report: dict[str, Any]) -> None:
    assert report["refused"] == (
        "3 prompt(s) x beam_width 3 need 9 sequences at once; this server holds 8: send fewer "
        "prompts or beams per request"
    )


def served(model: Path, tensor: int, pipeline: int) -> list:
    """tests/scripts/tp_serving_check.py's answers: the loop on rank 0 of a TP x PP group."""
    script = "tests.scripts.tp_serving_check"
    return module_report(
        script, str(model), str(tensor), str(pipeline), processes=tensor * pipeline
    )


def test_a_tp_or_pp_group_serves_what_one_process_serves(tiny_portable: Path) -> None:
    """Rank 0 schedules concurrent requests and the other ranks repeat its cache calls: the
    answers (greedy, beam search, seeded sampling) are one process's."""
    alone = served(tiny_portable, 1, 1)
    assert [len(answer) for answer in alone] == [2, 1, 1, 2]
    assert served(tiny_portable, 2, 1) == alone
    assert served(tiny_portable, 1, 2) == alone
