"""A reply's text on its way out: stop strings, then the reasoning router (think markers),
then the tool-call parser of the family's convention, then events.

Each filter holds back only what may still become a marker. :class:`Outputs` makes each
generation's :class:`Output` from the family's conventions, and the events that go with
a sampled token (log-probabilities) and a capped reasoning budget (the tokens that close
the think block). A reply the token bound cuts off inside a call gives the call, partial,
never its notation as text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .events import (
    EventSink,
    ReasoningDelta,
    TextDelta,
    TokenAlternative,
    TokenLogprob,
    ToolCallEvent,
)
from .model import FamilyConventions
from .reasoning import ThinkRouter
from .request import NormalizedRequest, ToolCall
from .stops import StopScanner
from .tokenizer import Tokenizer
from .tools import ToolCallParser

if TYPE_CHECKING:
    from .chat_prepare import Prepared


class Outputs:
    """How a family's replies are read: each generation's :class:`Output`, its log-probability
    events and the tokens that close a capped think block."""

    def __init__(self, conventions: FamilyConventions, tokenizer: Tokenizer) -> None:
        self.conventions = conventions
        self.tokenizer = tokenizer

    def open(self, sink: EventSink, request: NormalizedRequest, prepared: Prepared) -> Output:
        """The filters of one reply, sending its events into ``sink``."""
        return Output(
            sink,
            StopScanner(request.stop),
            self._router(request, prepared),
            self._reader(request, prepared),
        )

    def logprob_event(
        self, scored: tuple[int, float, list[tuple[int, float]]], out: Output
    ) -> TokenLogprob:
        """The event of a sampled token's log-probability and its top alternatives."""
        tok, logprob, top = scored

        def alt(token_id: int, value: float) -> TokenAlternative:
            raw = self.tokenizer.token_bytes(token_id)
            return TokenAlternative(raw.decode("utf-8", errors="replace"), value, list(raw))

        reasoning = out.router is not None and out.router.in_reasoning
        return TokenLogprob(alt(tok, logprob), [alt(i, v) for i, v in top], reasoning)

    def budget_close(self, request: NormalizedRequest, out: Output) -> tuple[int, list[int]] | None:
        """(budget, tokens that close the think block) when reasoning is capped."""
        markers = self.conventions.think
        if request.reasoning_budget is None or markers is None or out.router is None:
            return None
        closing = self.tokenizer.encode(markers.close + "\n\n", parse_special=True)
        return max(0, int(request.reasoning_budget)), closing

    def _reader(self, request: NormalizedRequest, prepared: Prepared) -> ToolCallParser | None:
        """The parser of the reply's text: the tool convention's when tools are in play, else
        the family's reply reader, if it has one."""
        if prepared.tools is not None:
            return prepared.tools.parser(request.tools)
        reader = self.conventions.reply_reader
        return None if reader is None else reader.parser(None)

    def _router(self, request: NormalizedRequest, prepared: Prepared) -> ThinkRouter | None:
        markers = self.conventions.think
        if markers is None or prepared.matcher is not None or request.prompt is not None:
            return None
        return ThinkRouter(markers, inside=prepared.think_inside)


class Output:
    """Text of the reply on its way out, through the filters in order: stop strings, the
    reasoning router, the tool-call parser; then events."""

    __slots__ = ("calls", "parser", "reasoning_tokens", "router", "scanner", "sink")

    def __init__(
        self,
        sink: EventSink,
        scanner: StopScanner,
        router: ThinkRouter | None,
        parser: ToolCallParser | None,
    ) -> None:
        self.sink = sink
        self.scanner = scanner
        self.router = router
        self.parser = parser
        self.reasoning_tokens = 0
        self.calls = 0

    def push(self, text: str, *, sampled: bool = True) -> bool:
        """Send one token's text on; True when a stop string fired. Tokens the server wrote
        into the reply itself (``sampled=False``) do not count as reasoning."""
        if sampled and self.router is not None and self.router.in_reasoning:
            self.reasoning_tokens += 1
        if not text:
            return False
        out, fired = self.scanner.feed(text)
        self._route(out)
        return fired is not None

    def reasoning_spent(self, budget: int) -> bool:
        """True while in the think block with ``budget`` reasoning tokens used up."""
        return (
            self.router is not None and self.router.in_reasoning and self.reasoning_tokens >= budget
        )

    def finish(self, *, cut: bool = False) -> None:
        """The reply ended: release everything held back. ``cut``: the token bound ended it,
        so a call it cut off comes back as a partial call and its notation never as text (a
        parser without ``cut`` flushes)."""
        self._route(self.scanner.flush())
        if self.router is not None:
            self._send(*self.router.flush())
        if self.parser is not None:
            release = getattr(self.parser, "cut", None) if cut else None
            text, calls = release() if release is not None else self.parser.flush()
            self._reply(text, calls)

    def _route(self, text: str) -> None:
        if not text:
            return
        if self.router is None:
            self._send("", text)
        else:
            self._send(*self.router.feed(text))

    def _send(self, reasoning: str, reply: str) -> None:
        if reasoning:
            self.sink.emit(ReasoningDelta(reasoning))
        if reply:
            if self.parser is None:
                self.sink.emit(TextDelta(reply))
            else:
                self._reply(*self.parser.feed(reply))

    def _reply(self, text: str, calls: list[ToolCall]) -> None:
        if text:
            self.sink.emit(TextDelta(text))
        for call in calls:
            self.calls += 1
            self.sink.emit(ToolCallEvent(call))
