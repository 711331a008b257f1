"""A scripted backend for HTTP-layer tests, registered through the plugin hooks.

Load it with ``lmserve --plugin fake_backend --backend scripted`` (``tests`` on
PYTHONPATH). The reply is driven by directives in the last user message:

* ``#reply:TEXT``   stream TEXT in small pieces (default: "Hello from scripted.")
* ``#tokens:N``     emit N tokens ``t0 t1 ...``
* ``#delay:MS``     sleep MS milliseconds before each token
* ``#error``        an in-band error after the first token
* ``#fail``         raise before any output
* ``#think:TEXT``   reasoning text before the reply
* ``#tool:NAME:JSON`` a tool call after the reply text
* ``#echo``         reply with one JSON object describing the request the backend received
                    (constraint, tools, tool choice, reasoning, messages, ...)

Directives end at the next `` #`` or the end of the message. Capabilities come from
``LMSERVE_SCRIPTED_CAPS`` (comma list of grammar, reasoning, tools, logit_bias; default
all). The vocabulary is the 256 byte values (``/tokenize``, ``logit_bias`` ids).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from lmserve_core import hookimpl
from lmserve_core.backend import Capabilities, ServerSettings
from lmserve_core.errors import BackendFailure, InvalidRequest
from lmserve_core.events import (
    ErrorEvent,
    EventSink,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallEvent,
    Usage,
)
from lmserve_core.request import NormalizedRequest, ToolCall
from lmserve_core.tools import HERMES

_DIRECTIVE = re.compile(
    r"#(reply|tokens|delay|error|fail|think|tool|echo)(?::(.*?))?(?=\s#|$)", re.S
)


def _capabilities() -> Capabilities:
    raw = os.environ.get("LMSERVE_SCRIPTED_CAPS", "grammar,reasoning,tools,logit_bias")
    caps = {c.strip() for c in raw.split(",")}
    return Capabilities(
        grammar="grammar" in caps,
        reasoning="reasoning" in caps,
        tools=HERMES if "tools" in caps else None,
        logit_bias="logit_bias" in caps,
        token_prompts="token_prompts" in caps,
    )


def _echo(request: NormalizedRequest) -> str:
    """What the backend received, as JSON (the ``#echo`` reply)."""
    c = request.constraint
    summary: dict[str, Any] = {
        "constraint": None
        if c is None
        else {"kind": c.kind, "source": c.source, "name": c.name, "strict": c.strict},
        "tools": [{"name": t.name, "strict": t.strict} for t in request.tools],
        "tool_choice": {"mode": request.tool_choice.mode.value, "name": request.tool_choice.name},
        "parallel_tool_calls": request.parallel_tool_calls,
        "reasoning": request.reasoning,
        "reasoning_budget": request.reasoning_budget,
        "prompt_tokens": request.prompt_tokens,
        "logit_bias": {str(k): v for k, v in (request.sampling.logit_bias or {}).items()},
        "template_kwargs": request.template_kwargs,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "reasoning": m.reasoning,
                "tool_calls": [c.name for c in m.tool_calls],
            }
            for m in request.messages
        ],
    }
    return json.dumps(summary)


def _pieces(text: str) -> list[str]:
    """Split into token-sized pieces: words with their leading space, long words in 3s."""
    out: list[str] = []
    for word in re.findall(r"\s*\S+|\s+", text):
        while len(word) > 4:
            out.append(word[:3])
            word = word[3:]
        out.append(word)
    return out


class ScriptedBackend:
    name = "scripted"
    model_id = "scripted-model"

    def __init__(self, settings: ServerSettings) -> None:
        self.capabilities = _capabilities()
        self.context_length = settings.ctx

    def _prompt_text(self, request: NormalizedRequest) -> str:
        if request.prompt_ids is not None:  # token-id prompts: each id a word
            return " ".join(map(str, request.prompt_ids))
        if request.prompt is not None:
            return request.prompt
        users = [m.content for m in request.messages if m.role == "user"]
        return users[-1] if users else ""

    def _prompt_tokens(self, request: NormalizedRequest) -> int:
        if request.prompt_ids is not None:
            return max(1, len(request.prompt_ids))
        text = request.prompt or " ".join(m.content for m in request.messages)
        return max(1, len(text.split()))

    def validate(self, request: NormalizedRequest) -> None:
        if request.prompt is None and request.prompt_ids is None and not request.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        n = self._prompt_tokens(request)
        if n >= self.context_length:
            raise InvalidRequest(
                f"prompt is {n} tokens; the context is {self.context_length}",
                code="context_length_exceeded",
            )
        request.prompt_tokens = n
        for token in request.sampling.logit_bias or ():
            if not 0 <= token < 256:
                raise InvalidRequest(
                    f"'logit_bias' key '{token}' is not a token id of this model",
                    param="logit_bias",
                )

    def generate(self, request: NormalizedRequest, sink: EventSink) -> Finish:
        directives = {name: (arg or "") for name, arg in _DIRECTIVE.findall(self._prompt_text(request))}
        if "fail" in directives:
            raise BackendFailure("scripted failure before output")
        delay = float(directives.get("delay") or 0) / 1000
        if "echo" in directives:
            text = _echo(request)
        elif "tokens" in directives:
            text = " ".join(f"t{i}" for i in range(int(directives["tokens"])))
        else:
            text = directives.get("reply") or "Hello from scripted."
        usage = Usage(prompt_tokens=self._prompt_tokens(request))
        if "think" in directives and request.reasoning:
            for piece in _pieces(directives["think"]):
                sink.emit(ReasoningDelta(piece))
                usage.completion_tokens += 1
                usage.reasoning_tokens += 1
        emitted = ""
        holdback = max((len(s) for s in request.stop), default=1) - 1
        produced = ""
        # an echo is one piece, so small max_tokens bounds never cut it
        pieces = [text] if "echo" in directives else _pieces(text)
        for i, piece in enumerate(pieces):
            if sink.cancelled:
                return Finish("cancelled", usage)
            if usage.completion_tokens >= request.max_tokens:
                if produced != emitted:
                    sink.emit(TextDelta(produced[len(emitted):]))
                return Finish("length", usage)
            if delay:
                time.sleep(delay)
            usage.completion_tokens += 1
            produced += piece
            for stop in request.stop:
                at = produced.find(stop)
                if at >= 0:
                    if at > len(emitted):
                        sink.emit(TextDelta(produced[len(emitted):at]))
                    return Finish("stop_sequence", usage, stop_sequence=stop)
            safe = len(produced) - holdback if request.stop else len(produced)
            if safe > len(emitted):
                sink.emit(TextDelta(produced[len(emitted):safe]))
                emitted = produced[:safe]
            if i == 0 and "error" in directives:
                sink.emit(ErrorEvent("scripted failure mid-stream", 500))
                return Finish("error", usage)
        if produced != emitted:
            sink.emit(TextDelta(produced[len(emitted):]))
        if "tool" in directives and request.tools:
            name, _, args = directives["tool"].partition(":")
            sink.emit(ToolCallEvent(ToolCall(id="call_0", name=name, arguments=args or "{}")))
            return Finish("tool_calls", usage)
        return Finish("stop", usage)

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return list(text.encode())

    def detokenize(self, ids: list[int]) -> str:
        if any(not 0 <= i < 256 for i in ids):
            raise InvalidRequest("token id out of range", param="tokens")
        return bytes(ids).decode(errors="replace")

    def token_piece(self, token_id: int) -> bytes:
        return bytes([token_id])

    def close(self) -> None:
        pass


@hookimpl
def register_backends(register):  # type: ignore[no-untyped-def]
    register(
        "scripted",
        lambda model, settings: ScriptedBackend(settings),
        description="scripted replies for HTTP-layer tests",
    )
