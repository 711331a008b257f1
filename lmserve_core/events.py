"""Events a backend emits while generating, and the sink it emits them into."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from .request import ToolCall

FinishReason = Literal["stop", "length", "tool_calls", "stop_sequence", "cancelled", "error"]


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TextDelta:
    """Reply text; always whole UTF-8 code points."""

    text: str


@dataclass(slots=True)
class ReasoningDelta:
    """Reasoning text routed out of the reply (a ``<think>`` head)."""

    text: str


@dataclass(slots=True)
class ToolCallEvent:
    """A completed function call found in the reply."""

    call: ToolCall


@dataclass(slots=True)
class TokenAlternative:
    """A token and its log-probability."""

    token: str  # its text (bytes that are not whole UTF-8 come out as U+FFFD)
    logprob: float
    bytes: list[int]  # its raw bytes


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of one sampled token and of the most likely alternatives
    (requests asking for logprobs). Sent before the text the token adds; ``reasoning``:
    the token was sampled inside the reasoning channel."""

    chosen: TokenAlternative
    top: list[TokenAlternative] = field(default_factory=list)
    reasoning: bool = False


@dataclass(slots=True)
class Finish:
    """How a generation ended: what ``generate`` returns, and the last event of a stream.

    ``usage`` may be left out (None): the engine then counts it (the prompt's tokens as the
    backend's ``validate`` set them in ``request.prompt_tokens``, or as its tokenizer counts
    them; the reply's tokens as core counted them, see ``lmserve_core.contract``).
    """

    reason: FinishReason
    usage: Usage | None = None
    stop_sequence: str | None = None  # the stop string that fired, if any


@dataclass(slots=True)
class ErrorEvent:
    """Generation failed; ``status`` is the HTTP status it would have had."""

    message: str
    status: int = 500
    kind: str = "server_error"


Event = TextDelta | ReasoningDelta | ToolCallEvent | TokenLogprob | Finish | ErrorEvent


class EventSink(Protocol):
    """Where a backend's ``generate`` sends its events (thread-safe, never blocks)."""

    def emit(self, event: Event) -> None:
        """Hand one event to the request's stream; never blocks on the client."""

    @property
    def cancelled(self) -> bool:
        """True once the client went away or the server is shutting down."""
