"""Inkling's conventions: the wire format's template, the reply blocks read while streaming,
the forced call's grammar."""

from __future__ import annotations

import json

import pytest
from lmserve_inkling.inkling_tools import INKLING_BLOCKS, INKLING_TOOLS, InklingParser
from lmserve_inkling.plugin import conventions, fallback_template

from lmserve_core.chat_template import ChatTemplate

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_template_renders_the_wire_format() -> None:
    t = ChatTemplate(fallback_template())
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert t.render(msgs, tools=TOOLS, enable_thinking=True) == (
        '<|message_system|>tool_declare<|content_xml|>[{"description":"Weather",'
        '"name":"get_weather","parameters":{"properties":{"city":{"type":"string"}},'
        '"type":"object"},"type":"function"}]<|end_message|>'
        "<|message_system|><|content_text|>Be brief.<|end_message|>"
        "<|message_system|><|content_text|>Thinking effort level: 0.9<|end_message|>"
        "<|message_user|><|content_text|>Hi<|end_message|>"
        "<|message_model|><|content_thinking|>hmm<|end_message|>"
        '<|message_model|>get_weather<|content_invoke_tool_json|>{"name":"get_weather",'
        '"args":{"city":"Paris"}}<|end_message|><|content_model_end_sampling|>'
        "<|message_tool|>get_weather<|content_text|>sunny<|end_message|><|message_model|>"
    )
    user = [{"role": "user", "content": "Hi"}]
    assert "level: 0<" in t.render(user, enable_thinking=False)
    assert "level: 0.35<" in t.render(user, enable_thinking=True, reasoning_effort=0.35)
    assert t.render(user, add_generation_prompt=False).endswith("Hi<|end_message|>")


def _stream(parser: InklingParser, text: str, step: int) -> tuple[str, list[object]]:
    out, calls = [], []
    for i in range(0, len(text), step):
        t, c = parser.feed(text[i : i + step])
        out.append(t)
        calls += c
    t, c = parser.flush()
    return "".join(out) + t, calls + c


REPLY = (
    "<|content_text|>Let me look.<|end_message|>"
    '<|message_model|>get_weather<|content_invoke_tool_json|>{"name": "get_weather", '
    '"args": {"city": "Paris"}}<|end_message|>'
    "<|message_model|><|content_text|> Done.<|end_message|>"
)


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_blocks_are_read_while_streaming(step: int) -> None:
    text, calls = _stream(INKLING_TOOLS.parser(), REPLY, step)
    assert text == "Let me look. Done."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [  # type: ignore[attr-defined]
        ("get_weather", {"city": "Paris"})
    ]
    # without tools in play the call block is text, markers dropped
    text, calls = _stream(INKLING_BLOCKS.parser(), REPLY, step)
    assert calls == [] and "get_weather{" in text and "<|" not in text


def test_text_outside_blocks_and_cut_calls() -> None:
    assert _stream(InklingParser(), "plain words, no blocks", 2) == ("plain words, no blocks", [])
    p = InklingParser()
    p.feed('f<|content_invoke_tool_json|>{"name": "f", "args": {"x": 1')
    text, calls = p.cut()
    assert text == "" and calls[0].name == "f" and calls[0].partial
    assert calls[0].arguments == '{"x": 1'


def test_conventions() -> None:
    c = conventions()
    assert c.think is not None and c.think.open == "<|content_thinking|>"
    assert c.think.close == "<|end_message|>"
    assert c.extra_stop_tokens == ("<|content_model_end_sampling|>",)
    assert "<|end_message|>" not in c.extra_stop_tokens and c.capabilities.tools is INKLING_TOOLS
    grammar = INKLING_TOOLS.forced_grammar(
        [("get_weather", TOOLS[0]["function"]["parameters"])], True, False  # type: ignore[index]
    )
    assert grammar.startswith("start: call (<|message_model|> call)*\n")
    assert '"get_weather" <|content_invoke_tool_json|> body0 <|end_message|>' in grammar
