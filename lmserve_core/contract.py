"""What core guarantees about every backend's reply, whatever the backend does itself.

The engine hands each backend a :class:`ReplySink` in place of the request's stream. It
applies the request's ``stop`` strings to the reply text and its ``max_tokens`` bound,
checks what the backend emits and returns, and counts the usage a backend leaves out. A
backend that already stops itself (the generic GGUF path) never reaches either bound
here, so for it the sink passes every event through unchanged.

Tokens are counted where core can see them: one per text or reasoning event of a
``generate`` backend, one per ``step`` of a batching backend in which the generation gave
text. A backend emits at most one such event per token; one that emits several tokens'
text at once counts its own tokens and stops at ``max_tokens`` itself (core's bound is then
looser than its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import get_args

from .events import (
    ErrorEvent,
    Event,
    EventSink,
    Finish,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    TokenAlternative,
    TokenLogprob,
    ToolCallEvent,
    Usage,
)
from .request import NormalizedRequest, ToolCall
from .stops import StopScanner

FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


class ContractError(TypeError):
    """A backend emitted or returned something the Backend contract does not allow."""


class ReplySink:
    """The sink a backend emits into: the request's stream behind the bounds core applies.

    ``per_step``: the backend batches, and the engine calls :meth:`step_done` after each
    ``step``. A text event whose end may be the start of a stop string waits, whole, until
    the text after it shows whether the stop follows (log-probabilities wait behind it, in
    order); it is released unchanged before reasoning, a tool call or an error (a stop
    string matches within the reply's text) and at the end. Only a stop core finds itself
    cuts an event, so the events of a backend that stops itself pass unchanged.
    """

    __slots__ = (
        "_count_prompt",
        "_pending",
        "_out",
        "_per_step",
        "_reasoning_step",
        "_request",
        "_scanner",
        "_stepped",
        "ended",
        "reasoning_tokens",
        "tokens",
    )

    def __init__(
        self,
        out: EventSink,
        request: NormalizedRequest,
        *,
        per_step: bool = False,
        count_prompt: Callable[[NormalizedRequest], int] | None = None,
    ) -> None:
        self._out = out
        self._request = request
        self._count_prompt = count_prompt
        self._scanner = StopScanner(request.stop) if request.stop else None
        self._pending: list[TextDelta | TokenLogprob] = []  # waiting on a possible stop
        self._per_step = per_step
        self._stepped = False
        self._reasoning_step = False
        self.tokens = 0  # the reply's tokens as core counts them
        self.reasoning_tokens = 0
        self.ended: Finish | None = None  # how core ended the reply, when it did

    @property
    def cancelled(self) -> bool:
        return self.ended is not None or self._out.cancelled

    def emit(self, event: Event) -> None:
        if self.ended is not None:
            if not isinstance(event, _EVENTS):
                raise _bad_event(event)
            return  # the reply is over: what the backend sends before it notices is dropped
        if isinstance(event, TextDelta | ReasoningDelta):
            if not isinstance(event.text, str):
                raise ContractError(
                    f"{type(event).__name__}.text must be a str, not {type(event.text).__name__}"
                )
            if not event.text:
                return
            if not self._count(isinstance(event, ReasoningDelta)):
                self._release()
                self.ended = Finish("length")
                return
            if isinstance(event, ReasoningDelta) or self._scanner is None:
                self._release()
                self._out.emit(event)
                return
            self._scan(event, self._scanner)
        elif isinstance(event, TokenLogprob):
            if not isinstance(event.chosen, TokenAlternative):
                raise ContractError("TokenLogprob.chosen must be a TokenAlternative")
            if self._pending:
                self._pending.append(event)
            else:
                self._out.emit(event)
        elif isinstance(event, ToolCallEvent | ErrorEvent):
            _check_fields(event)
            self._release()
            self._out.emit(event)
        else:
            raise _bad_event(event)

    def step_done(self) -> None:
        """A batching backend's ``step`` returned: one token for a generation that gave text."""
        if self._stepped:
            self.tokens += 1
            self.reasoning_tokens += self._reasoning_step
            self._stepped = self._reasoning_step = False

    def close(self, finish: object) -> Finish:
        """The reply's ``Finish``: core's when core ended the reply, else the backend's; held
        text released; usage counted where the backend gave none. Raises ``ContractError``
        when ``finish`` is not a ``Finish``."""
        if not isinstance(finish, Finish):
            raise ContractError(f"generate must return a Finish, not {type(finish).__name__}")
        if finish.reason not in FINISH_REASONS:
            raise ContractError(
                f"Finish.reason must be one of {', '.join(sorted(FINISH_REASONS))}, "
                f"not {finish.reason!r}"
            )
        if finish.usage is not None and not isinstance(finish.usage, Usage):
            raise ContractError(
                f"Finish.usage must be a Usage or None, not {type(finish.usage).__name__}"
            )
        self.step_done()
        if self.ended is not None and finish.reason != "error":
            usage = finish.usage
            if usage is not None and usage.completion_tokens > self._request.max_tokens:
                usage = replace(usage, completion_tokens=self._request.max_tokens)
            finish = replace(self.ended, usage=usage)
        elif finish.reason != "error":
            self._release()
        if finish.usage is None:
            finish = replace(finish, usage=self._counted())
        return finish

    # ------------------------------------------------------------------ internals

    def _count(self, reasoning: bool) -> bool:
        """Count a token of text; False when it is past ``max_tokens``."""
        if self.tokens >= self._request.max_tokens:
            return False
        if self._per_step:
            self._stepped = True
            self._reasoning_step |= reasoning
        else:
            self.tokens += 1
            self.reasoning_tokens += reasoning
        return True

    def _scan(self, event: TextDelta, scanner: StopScanner) -> None:
        pending = self._pending
        held_before = len(scanner.held)  # the tail of the pending text the scanner holds
        out, fired = scanner.feed(event.text)
        if fired is not None:  # core's own stop: what precedes it, in one event
            text = "".join(e.text for e in pending if isinstance(e, TextDelta))
            before = text[: len(text) - held_before] + out
            for e in pending:
                if isinstance(e, TokenLogprob):
                    self._out.emit(e)
            pending.clear()
            if before:
                self._out.emit(TextDelta(before))
            self.ended = Finish("stop_sequence", stop_sequence=fired)
            return
        pending.append(event)
        held = len(scanner.held)
        if not held:
            self._send_pending(len(pending))
            return
        # send the events that end before the held tail starts
        safe = sum(len(e.text) for e in pending if isinstance(e, TextDelta)) - held
        pos = count = 0
        for e in pending:
            if isinstance(e, TextDelta):
                if pos + len(e.text) > safe:
                    break
                pos += len(e.text)
            count += 1
        self._send_pending(count)

    def _send_pending(self, count: int) -> None:
        for e in self._pending[:count]:
            self._out.emit(e)
        del self._pending[:count]

    def _release(self) -> None:
        if self._pending:
            assert self._scanner is not None
            self._scanner.flush()
            self._send_pending(len(self._pending))

    def _counted(self) -> Usage:
        request = self._request
        prompt = request.prompt_tokens
        if prompt is None:
            prompt = self._count_prompt(request) if self._count_prompt is not None else 0
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=self.tokens,
            reasoning_tokens=self.reasoning_tokens,
        )


_EVENTS = (TextDelta, ReasoningDelta, ToolCallEvent, TokenLogprob, ErrorEvent)


def _check_fields(event: ToolCallEvent | ErrorEvent) -> None:
    """The fields the dialects' encoders read, of the types they read them as."""
    if isinstance(event, ToolCallEvent):
        call = event.call
        if not isinstance(call, ToolCall) or not all(
            isinstance(v, str) for v in (call.id, call.name, call.arguments)
        ):
            raise ContractError("ToolCallEvent.call must be a ToolCall of str id, name, arguments")
    elif not isinstance(event.message, str) or not isinstance(event.status, int):
        raise ContractError("ErrorEvent needs a str message and an int status")


def _bad_event(event: object) -> ContractError:
    if isinstance(event, Finish):
        return ContractError("a backend returns its Finish from generate; it does not emit it")
    return ContractError(
        "a backend emits TextDelta, ReasoningDelta, ToolCallEvent, TokenLogprob or ErrorEvent, "
        f"not {type(event).__name__}"
    )
