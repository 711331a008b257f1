"""An example lmserve plugin: a backend that reverses the user's words."""

from __future__ import annotations

from lmserve_core import hookimpl
from lmserve_core.backend import Capabilities, ServerSettings
from lmserve_core.errors import InvalidRequest
from lmserve_core.events import EventSink, Finish, TextDelta, Usage
from lmserve_core.request import NormalizedRequest


class ReverseBackend:
    name = "reverse"
    model_id = "reverse"
    # No grammar engine, no reasoning channel, no tool convention: the dialects refuse
    # requests that need them, naming the field.
    capabilities = Capabilities(grammar=False, reasoning=False)

    def __init__(self, settings: ServerSettings) -> None:
        self.context_length = settings.ctx

    def _words(self, request: NormalizedRequest) -> list[str]:
        if request.prompt is not None:
            return request.prompt.split()
        users = [m.content for m in request.messages if m.role == "user"]
        return users[-1].split() if users else []

    def validate(self, request: NormalizedRequest) -> None:
        """Cheap checks on the connection path: shape and length."""
        if not self._words(request):
            raise InvalidRequest("the last user message has no words", param="messages")
        if len(self._words(request)) >= self.context_length:
            raise InvalidRequest("prompt too long", code="context_length_exceeded")

    def generate(self, request: NormalizedRequest, sink: EventSink) -> Finish:
        """Runs on the inference worker: emit events, return how it ended."""
        words = self._words(request)
        usage = Usage(prompt_tokens=len(words))
        text = ""
        for i, word in enumerate(reversed(words)):
            if sink.cancelled:
                return Finish("cancelled", usage)
            if usage.completion_tokens == request.max_tokens:
                return Finish("length", usage)
            piece = word if i == 0 else " " + word
            for stop in request.stop:
                if stop in text + piece:
                    cut = (text + piece).index(stop)
                    if cut > len(text):
                        sink.emit(TextDelta((text + piece)[len(text):cut]))
                    return Finish("stop_sequence", usage, stop_sequence=stop)
            sink.emit(TextDelta(piece))
            text += piece
            usage.completion_tokens += 1
        return Finish("stop", usage)

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return [len(word) for word in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)

    def token_piece(self, token_id: int) -> bytes:
        return b"x" * token_id

    def close(self) -> None:
        pass


@hookimpl
def register_backends(register):  # type: ignore[no-untyped-def]
    register(
        "reverse",
        lambda model_path, settings: ReverseBackend(settings),
        description="example: answers with the user's words reversed",
    )
