from __future__ import annotations

import pytest

from lmserve_core.stops import StopScanner


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], str | None, str]:
    """Feed chunks; return what was emitted per chunk, the stop that fired, and the flush."""
    scanner = StopScanner(stops)
    out: list[str] = []
    fired = None
    for chunk in chunks:
        text, fired = scanner.feed(chunk)
        out.append(text)
        if fired:
            break
    return out, fired, scanner.flush()


def test_no_stops_passes_text_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b"], None, "")
    assert run([""], ["a"]) == (["a"], None, "")


def test_stop_inside_one_chunk_emits_the_text_before_it() -> None:
    out, fired, rest = run(["END"], ["hello END world"])
    assert out == ["hello "] and fired == "END" and rest == ""


def test_stop_spanning_chunks_is_never_emitted() -> None:
    out, fired, _ = run(["<|stop|>"], ["Hi <", "|st", "op", "|> after"])
    assert "".join(out) == "Hi "
    assert fired == "<|stop|>"
    # nothing that could start the stop string ever leaves the scanner early
    assert out[0] == "Hi "


def test_held_text_is_released_once_it_cannot_match() -> None:
    out, fired, rest = run(["STOP"], ["a ST", "ranger"])
    assert out == ["a ", "STranger"] and fired is None and rest == ""


def test_flush_releases_a_trailing_partial_match() -> None:
    out, fired, rest = run(["STOP"], ["the end ST"])
    assert out == ["the end "] and fired is None and rest == "ST"


def test_first_completed_stop_wins_and_is_reported() -> None:
    assert run(["world", "lo w"], ["hello world"])[:2] == (["hel"], "lo w")
    # same end: the one starting earlier
    assert run(["b", "ab"], ["xab"])[:2] == (["x"], "ab")
    # independent of chunking
    assert run(["b", "ab"], ["x", "a", "b"])[:2] == (["x", "", ""], "ab")


def test_overlapping_prefix_hold_keeps_the_longest_candidate() -> None:
    # "aab": after "aa" both "a" and "aa" could start the stop
    out, fired, _ = run(["aab"], ["xa", "a", "ab"])
    assert "".join(out) == "xa" and fired == "aab"


def test_multibyte_text_and_stops() -> None:
    out, fired, _ = run(["🙂👋"], ["héllo 🙂", "👋 bye"])
    assert "".join(out) == "héllo " and fired == "🙂👋"
    out, fired, rest = run(["→→"], ["日本→", "語"])
    assert "".join(out) + rest == "日本→語" and fired is None


def test_feed_after_stop_is_ignored() -> None:
    scanner = StopScanner(["x"])
    assert scanner.feed("axb") == ("a", "x")
    assert scanner.feed("more") == ("", "x")
    assert scanner.flush() == ""


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_chunk_size_does_not_change_the_result(size: int) -> None:
    text = "one two <stop> three"
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    out, fired, rest = run(["<stop>", "four"], chunks)
    assert "".join(out) + rest == "one two " and fired == "<stop>"
