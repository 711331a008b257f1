"""The per-request stream pipe: the worker's events reach the event loop in order, a run of
them with one wake-up, and the text of one run as one delta."""

from __future__ import annotations

import asyncio
import threading

from lmserve_core.engine import RequestStream
from lmserve_core.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenAlternative,
    TokenLogprob,
    ToolCallEvent,
)
from lmserve_core.request import NormalizedRequest, ToolCall


def _stream(loop: asyncio.AbstractEventLoop) -> RequestStream:
    return RequestStream(NormalizedRequest(id="r", dialect="chat"), loop)


async def _read(stream: RequestStream) -> list[object]:
    return [event async for event in stream]


def test_a_run_of_text_is_read_as_one_delta_and_other_events_keep_their_place() -> None:
    async def main() -> list[object]:
        stream = _stream(asyncio.get_running_loop())
        logprob = TokenLogprob(TokenAlternative("c", -0.5, [99]))
        call = ToolCallEvent(ToolCall("id", "f", "{}"))
        for event in (ReasoningDelta("th"), ReasoningDelta("ink"), TextDelta("a"),
                      TextDelta("b"), logprob, TextDelta("c"), call, TextDelta("d"),
                      TextDelta("e"), Finish("stop")):
            stream.emit(event)
        stream._close()
        return await _read(stream)

    events = asyncio.run(main())
    assert events[:3] == [ReasoningDelta("think"), TextDelta("ab"), events[2]]
    assert isinstance(events[2], TokenLogprob)  # a token's logprob stays before its text
    assert events[3:] == [TextDelta("c"), events[4], TextDelta("de"), Finish("stop")]
    assert isinstance(events[4], ToolCallEvent)


def test_events_from_another_thread_arrive_whole_and_in_order() -> None:
    """A worker emitting while the loop reads: no event lost or reordered, whatever the
    interleaving of wake-ups and reads."""

    async def main() -> str:
        stream = _stream(asyncio.get_running_loop())

        def worker() -> None:
            for i in range(5000):
                stream.emit(TextDelta(f"{i},"))
                if i % 7 == 0:
                    stream.emit(ReasoningDelta("."))
            stream._close()

        thread = threading.Thread(target=worker)
        thread.start()
        text = "".join(e.text for e in await _read(stream) if isinstance(e, TextDelta))
        thread.join()
        return text

    assert asyncio.run(main()) == "".join(f"{i}," for i in range(5000))


def test_a_reader_waiting_before_the_first_event_is_woken() -> None:
    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        stream = _stream(loop)
        reader = asyncio.create_task(_read(stream))
        await asyncio.sleep(0.01)  # the reader is waiting now
        threading.Thread(target=lambda: (stream.emit(TextDelta("x")), stream._close())).start()
        return await asyncio.wait_for(reader, 5)

    assert asyncio.run(main()) == [TextDelta("x")]
