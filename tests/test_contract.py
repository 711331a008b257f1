"""The contract core enforces for every backend (``lmserve_core.contract``): stop strings and
``max_tokens`` applied whatever the backend does, usage counted where a backend leaves it
out, and a backend that breaks the contract answered with a 500 logged as one.

A backend that stops itself (the generic GGUF path) must come out exactly as it went in:
the same events, chunk by chunk, and the same finish.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from litestar.testing import TestClient
from scripted import (  # noqa: F401  (the fixtures)
    IM_END,
    ListSink,
    _gguf,
    _one_tokenizer,
    _tokenizer,
    chat,
    ids,
    make_backend,
)
from structlog.testing import capture_logs

from lmserve_core.app import create_app
from lmserve_core.backend import Capabilities, ServerSettings, ThinkMarkers
from lmserve_core.contract import ContractError, ReplySink
from lmserve_core.engine import Engine
from lmserve_core.events import (
    ErrorEvent,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenAlternative,
    TokenLogprob,
    ToolCallEvent,
    Usage,
)
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.request import NormalizedRequest, Tool, ToolCall
from lmserve_core.server import Server
from lmserve_core.tools import HERMES

# ---------------------------------------------------------------------------- the sink alone


def request(**kw: Any) -> NormalizedRequest:
    return NormalizedRequest(id="r", dialect="chat", **kw)


def pour(sink: ReplySink, *pieces: str) -> None:
    for piece in pieces:
        if sink.cancelled:
            return
        sink.emit(TextDelta(piece))


def test_a_stop_across_events_ends_the_reply_and_is_never_sent() -> None:
    out = ListSink()
    sink = ReplySink(out, request(stop=["c d"]))
    pour(sink, "a ", "b ", "c", " d", " e")
    assert sink.cancelled  # the backend is told to stop
    assert out.text == "a b " and all("c" not in e.text for e in out.events)  # type: ignore[union-attr]
    finish = sink.close(Finish("cancelled"))
    assert (finish.reason, finish.stop_sequence) == ("stop_sequence", "c d")


def test_held_text_that_is_no_stop_is_released_before_other_events_and_at_the_end() -> None:
    call = ToolCall(id="c1", name="f", arguments="{}")
    out = ListSink()
    sink = ReplySink(out, request(stop=["xyz"]))
    sink.emit(TextDelta("ab x"))
    sink.emit(ToolCallEvent(call))
    sink.emit(TextDelta("then xy"))
    # an event that may end in the stop's start waits whole, and goes unchanged
    assert [getattr(e, "text", None) for e in out.events] == ["ab x", None]
    finish = sink.close(Finish("tool_calls"))
    assert out.events[-1] == TextDelta("then xy") and finish.reason == "tool_calls"


def test_logprobs_do_not_break_a_stop_string_between_tokens() -> None:
    lp = TokenLogprob(TokenAlternative("x", -0.1, [120]))
    out = ListSink()
    sink = ReplySink(out, request(stop=["ab"]))
    for piece in ("a", "b"):
        sink.emit(lp)
        sink.emit(TextDelta(piece))
    assert sink.cancelled and out.text == ""


def test_max_tokens_counts_text_and_reasoning_events() -> None:
    out = ListSink()
    sink = ReplySink(out, request(max_tokens=3))
    sink.emit(ReasoningDelta("hm"))
    pour(sink, "a", "b", "c")
    assert out.reasoning == "hm" and out.text == "ab" and sink.cancelled
    finish = sink.close(Finish("stop"))
    assert finish.reason == "length"
    assert finish.usage == Usage(prompt_tokens=0, completion_tokens=3, reasoning_tokens=1)


def test_a_batching_backend_is_counted_per_step() -> None:
    out = ListSink()
    sink = ReplySink(out, request(max_tokens=2), per_step=True)
    for _ in range(2):  # a step may send a token's text in several events
        sink.emit(ReasoningDelta("r"))
        sink.emit(TextDelta("t"))
        sink.step_done()
    sink.emit(TextDelta("over"))
    assert out.text == "tt" and sink.cancelled
    assert sink.close(Finish("cancelled", Usage(5, 3))) == Finish("length", Usage(5, 2))


def test_usage_left_out_is_counted() -> None:
    def count(req: NormalizedRequest) -> int:
        return 7

    sink = ReplySink(ListSink(), request(), count_prompt=count)
    pour(sink, "a", "b")
    assert sink.close(Finish("stop")).usage == Usage(prompt_tokens=7, completion_tokens=2)
    given = Usage(prompt_tokens=3, completion_tokens=9)
    assert ReplySink(ListSink(), request()).close(Finish("stop", given)).usage is given


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (None, "must return a Finish, not NoneType"),
        (Finish("done"), "Finish.reason must be one of"),  # type: ignore[arg-type]
        (Finish("stop", {"prompt_tokens": 1}), "Finish.usage must be a Usage"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_finish_is_a_contract_error(returned: Any, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        ReplySink(ListSink(), request()).close(returned)


def test_emitting_what_is_no_event_is_a_contract_error() -> None:
    sink = ReplySink(ListSink(), request())
    with pytest.raises(ContractError, match="returns its Finish"):
        sink.emit(Finish("stop"))
    with pytest.raises(ContractError, match="not str"):
        sink.emit("text")  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="must be a str"):
        sink.emit(TextDelta(b"bytes"))  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="ToolCallEvent.call"):
        sink.emit(ToolCallEvent({"name": "f"}))  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="ErrorEvent"):
        sink.emit(ErrorEvent(None))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- a no-op for families

WEATHER = Tool(name="get_weather", parameters={"type": "object", "properties": {}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def drive(backend: Any, req: NormalizedRequest, sink: Any) -> Finish:
    """Generate ``req`` as the engine's worker does, a step at a time."""
    backend.validate(req)
    gen = backend.begin(req, sink)
    while gen.finish is None:
        backend.step([gen])
        if isinstance(sink, ReplySink):
            sink.step_done()
    return sink.close(gen.finish) if isinstance(sink, ReplySink) else gen.finish


def unnamed(events: list[Any]) -> list[Any]:
    """``events`` with their calls' ids left out (each run draws new ones)."""
    return [
        ToolCallEvent(dataclasses.replace(e.call, id="")) if isinstance(e, ToolCallEvent) else e
        for e in events
    ]


def uncached(finish: Finish) -> Finish:
    """``finish`` without its cache hits (the second run of a prompt reuses the first's)."""
    assert finish.usage is not None
    return dataclasses.replace(finish, usage=dataclasses.replace(finish.usage, cached_tokens=0))


CASES = [
    ("Hello world. END here", {"stop": ["ld. EN", "zzz"]}, {}),
    ("Hello world.", {"stop": ["world!"]}, {}),
    ("Hello world, hello moon.", {"stop": ["o m", "lo"]}, {}),
    ("one two three four five six", {"stop": ["x"]}, {}),
    (
        "Let me look.\n" + CALL + "\n" + CALL,
        {"tools": [WEATHER], "stop": ["k.\n\n"]},
        {"capabilities": Capabilities(grammar=True, tools=HERMES)},
    ),
    (
        "Let me look.\n<tool_call>\n{oops}\n</tool_call> ok",
        {"tools": [WEATHER], "stop": ["l>!"]},
        {"capabilities": Capabilities(grammar=True, tools=HERMES)},
    ),
    (
        "<think>\nLet me count.\n</think>\n\nFour, ou.",
        {"reasoning": True, "stop": ["ou."]},
        {"think": ThinkMarkers()},
    ),
]


@pytest.mark.parametrize(("reply", "fields", "conventions"), CASES)
def test_core_bounds_change_nothing_for_the_generic_path(
    gguf: GGUFFile, reply: str, fields: dict[str, Any], conventions: dict[str, Any]
) -> None:
    script = ids(make_backend(gguf), reply) + [IM_END]
    backend = make_backend(gguf, script, **conventions)
    for max_tokens in [*range(1, len(script) + 2), 1024]:
        plain, wrapped = ListSink(), ListSink()
        alone = drive(backend, chat("hi", max_tokens=max_tokens, **fields), plain)
        req = chat("hi", max_tokens=max_tokens, **fields)
        bounded = drive(backend, req, ReplySink(wrapped, req, per_step=True))
        assert unnamed(wrapped.events) == unnamed(plain.events), max_tokens
        assert uncached(bounded) == uncached(alone), max_tokens
    assert any(isinstance(e, TextDelta) for e in plain.events)


@pytest.mark.slow
def test_core_bounds_change_nothing_for_smollm2() -> None:
    """The real model, sampled (seeded), with stop strings and bounds that it meets."""
    from models import smollm2_path

    llama = pytest.importorskip("lmserve_llama.plugin")
    from lmserve_core.request import Sampling

    backend = llama.create_backend(str(smollm2_path()), ServerSettings(ctx=512, threads=2))
    try:
        fired = 0
        for max_tokens, stop in [(40, ["e", "the"]), (24, [" is", "\n"]), (7, []), (60, ["."])]:
            runs = []
            for bounded in (False, True):
                req = chat(
                    "Tell me about Paris.",
                    max_tokens=max_tokens,
                    stop=stop,
                    sampling=Sampling(temperature=0.8, seed=3),
                )
                out = ListSink()
                finish = drive(backend, req, ReplySink(out, req, per_step=True) if bounded else out)
                runs.append((out.events, finish))
            assert unnamed(runs[0][0]) == unnamed(runs[1][0]) and uncached(runs[0][1]) == uncached(
                runs[1][1]
            )
            fired += runs[0][1].reason == "stop_sequence"
        assert fired >= 2
    finally:
        backend.close()


# ---------------------------------------------------------------------------- through the server


class EchoBackend:
    """What a plugin author writes from docs/plugins.md: no bounds, no usage."""

    name = "echo"
    model_id = "echo"
    capabilities = Capabilities()
    context_length = 4096

    def __init__(self, fail: str = "") -> None:
        self.fail = fail

    def validate(self, request: NormalizedRequest) -> None:
        pass

    def generate(self, request: NormalizedRequest, sink: Any) -> Any:
        text = request.prompt if request.prompt is not None else request.messages[-1].content
        if self.fail == "before":
            raise RuntimeError("no luck")
        for word in text.split():
            if sink.cancelled:
                return Finish("cancelled", None)
            sink.emit(TextDelta(word + " "))
            if self.fail == "during":
                raise RuntimeError("no luck mid-way")
        return None if self.fail == "return" else Finish("stop", None)

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return list(text.encode())

    def detokenize(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def token_piece(self, token_id: int) -> bytes:
        return bytes([token_id])

    def close(self) -> None:
        pass


def serve(backend: Any) -> tuple[TestClient[Any], Engine]:
    engine = Engine(backend)
    return TestClient(create_app(Server(engine=engine, settings=ServerSettings()))), engine


def sse(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_an_echo_backend_gets_bounds_usage_and_raw_completions() -> None:
    client, engine = serve(EchoBackend())
    chat_url = "/v1/chat/completions"
    user = [{"role": "user", "content": "a b c d e"}]
    with client:
        body = client.post(chat_url, json={"messages": user, "max_tokens": 2}).json()
        assert body["choices"][0]["message"]["content"] == "a b "
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 2
        assert body["usage"]["prompt_tokens"] == len(b"a b c d e")  # its tokenizer's count
        body = client.post(chat_url, json={"messages": user, "stop": ["c d"]}).json()
        assert body["choices"][0]["message"]["content"] == "a b "
        assert body["choices"][0]["finish_reason"] == "stop"
        frames = sse(
            client.post(
                chat_url,
                json={
                    "messages": user,
                    "stream": True,
                    "stop": ["d e"],
                    "max_tokens": 5,
                    "stream_options": {"include_usage": True},
                },
            ).text
        )
        text = "".join(
            f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"]
        )
        assert text == "a b c "
        assert [f["choices"][0]["finish_reason"] for f in frames if f["choices"]][-1] == "stop"
        assert frames[-1]["usage"]["completion_tokens"] == 5
        body = client.post("/v1/completions", json={"prompt": "x y z", "max_tokens": 2}).json()
        assert body["choices"][0]["text"] == "x y " and body["usage"]["completion_tokens"] == 2
    engine.stop()


@pytest.mark.parametrize("fail", ["before", "during", "return"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_backend_is_a_500_logged_as_one(fail: str, stream: bool) -> None:
    client, engine = serve(EchoBackend(fail))
    with capture_logs() as logs:
        with client:
            reply = client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "a b"}],
                    "stream": stream,
                },
            )
            if stream and fail != "before":  # the stream had begun: an in-band error
                assert reply.status_code == 200
                assert "error" in sse(reply.text)[-1]
            else:
                assert reply.status_code == 500, reply.text
                assert reply.json()["error"]["type"] == "server_error"
        engine.stop()  # the worker writes the line once the stream is closed
    lines = [line for line in logs if line["event"] == "request"]
    assert [(line["status"], line["finish_reason"]) for line in lines] == [(500, "error")]
    if fail == "return":
        assert "must return a Finish" in (reply.text if not stream else str(sse(reply.text)))


def test_a_stopped_stream_holds_back_only_what_may_be_the_stop() -> None:
    """Client-visible chunks of a stop-bounded stream: a possible start of the stop waits,
    the rest is sent as it comes."""
    client, engine = serve(EchoBackend())
    with client:
        reply = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "one two three"}],
                "stream": True,
                "stop": ["o th"],
            },
        )
    engine.stop()
    chunks = [f["choices"][0]["delta"].get("content") for f in sse(reply.text) if f["choices"]]
    chunks = [c for c in chunks if c]
    assert "".join(chunks) == "one tw"
    assert not any(c.endswith("o") or c.endswith("o ") for c in chunks)


def test_error_events_pass_through() -> None:
    out = ListSink()
    sink = ReplySink(out, request(stop=["zz"]))
    sink.emit(TextDelta("a"))
    sink.emit(TextDelta("b z"))
    sink.emit(ErrorEvent("boom"))
    assert out.events == [TextDelta("a"), TextDelta("b z"), ErrorEvent("boom")]


def test_only_the_events_the_held_tail_reaches_wait() -> None:
    lp = TokenLogprob(TokenAlternative("x", -0.1, [120]))
    out = ListSink()
    sink = ReplySink(out, request(stop=["the end"]))
    for piece in ("so", " t", "h"):
        sink.emit(lp)
        sink.emit(TextDelta(piece))
    assert out.events == [lp, TextDelta("so"), lp]  # " t" and "h" may begin "the end"
    sink.emit(TextDelta("is"))
    assert out.events == [
        lp,
        TextDelta("so"),
        lp,
        TextDelta(" t"),
        lp,
        TextDelta("h"),
        TextDelta("is"),
    ]
