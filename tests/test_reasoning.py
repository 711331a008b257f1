from __future__ import annotations

import pytest

from lmserve_core.backend import ThinkMarkers
from lmserve_core.reasoning import ThinkRouter


def route(chunks: list[str], *, inside: bool = False) -> tuple[str, str]:
    router = ThinkRouter(ThinkMarkers(), inside=inside)
    reasoning, reply = "", ""
    for chunk in chunks:
        r, t = router.feed(chunk)
        reasoning += r
        reply += t
    r, t = router.flush()
    return reasoning + r, reply + t


def chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize(
    "split", [chars, lambda s: [s], lambda s: [s[:3], s[3:10], s[10:22], s[22:]]]
)
def test_leading_think_block_is_routed(split) -> None:  # type: ignore[no-untyped-def]
    text = "<think>\nLet me see.\n</think>\n\nThe answer is 4."
    assert route(split(text)) == ("Let me see.", "The answer is 4.")


def test_stray_leading_close_is_dropped() -> None:
    assert route(chars("</think>\n\nHello")) == ("", "Hello")


def test_plain_reply_passes_and_later_markers_are_text() -> None:
    assert route(chars("Hi <think>x</think>")) == ("", "Hi <think>x</think>")
    assert route(["<thi", "s is text"]) == ("", "<this is text")
    assert route(["\n  ok"]) == ("", "\n  ok")


def test_unclosed_think_is_all_reasoning() -> None:
    assert route(chars("<think>still going</th")) == ("still going</th", "")


def test_prompt_opened_think_block() -> None:
    assert route(chars("plan\n</think>\n\ndone"), inside=True) == ("plan", "done")


def test_reasoning_streams_before_the_close() -> None:
    router = ThinkRouter(ThinkMarkers())
    assert router.feed("<think>abc") == ("abc", "")
    assert router.feed(" def</") == (" def", "")
    assert router.feed("think>") == ("", "")
    assert router.feed("x") == ("", "x")
