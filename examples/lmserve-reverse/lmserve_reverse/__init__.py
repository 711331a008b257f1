"""An example lmserve plugin: a backend that answers with the prompt's words reversed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmserve_core import hookimpl
from lmserve_core.backend import Capabilities, ServerSettings
from lmserve_core.errors import InvalidRequest
from lmserve_core.events import EventSink, Finish, TextDelta
from lmserve_core.request import NormalizedRequest


class ReverseBackend:
    name = "reverse"
    model_id = "reverse"
    # No grammar engine, no reasoning channel, no tool convention: the dialects refuse
    # requests that need them, naming the field.
    capabilities = Capabilities()

    def __init__(self, settings: ServerSettings) -> None:
        self.context_length = settings.ctx

    def validate(self, request: NormalizedRequest) -> None:
        """Cheap checks on the connection path; the prompt's length in tokens."""
        words = _words(request)
        if not words:
            field = "prompt" if request.prompt is not None else "messages"
            raise InvalidRequest("the prompt has no words", param=field)
        if len(words) >= self.context_length:
            raise InvalidRequest("prompt too long", code="context_length_exceeded")
        request.prompt_tokens = len(words)

    def generate(self, request: NormalizedRequest, sink: EventSink) -> Finish:
        """Runs on the inference worker: one event per token, then how it ended. The
        engine applies ``max_tokens`` and ``stop`` and counts the reply's tokens."""
        for i, word in enumerate(reversed(_words(request))):
            if sink.cancelled:
                return Finish("cancelled")
            sink.emit(TextDelta(word if i == 0 else " " + word))
        return Finish("stop")

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return [len(word) for word in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)

    def token_piece(self, token_id: int) -> bytes:
        return b"x" * token_id

    def close(self) -> None:
        pass


def _words(request: NormalizedRequest) -> list[str]:
    """The words of the raw prompt (/v1/completions) or else of the last user message."""
    if request.prompt is not None:
        return request.prompt.split()
    users = [m.content for m in request.messages if m.role == "user"]
    return users[-1].split() if users else []


def _create(model_path: str | None, settings: ServerSettings) -> ReverseBackend:
    return ReverseBackend(settings)  # no model file: model_path is None


@hookimpl
def register_backends(register: Callable[..., Any]) -> None:
    register("reverse", _create, description="example: answers with the prompt's words reversed")
