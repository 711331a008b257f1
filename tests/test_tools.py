"""Tool-call conventions: the streaming parsers at every split, and the forced-call grammars
compiled and walked by llguidance."""

from __future__ import annotations

import codecs
import itertools
import json
from typing import Any

import llguidance
import pytest

from lmserve_core.backend import ThinkMarkers
from lmserve_core.reasoning import ThinkRouter
from lmserve_core.request import Tool
from lmserve_core.tools import HERMES, JSON_CALL, QWEN_XML, forced_call_grammar

WEATHER = Tool(
    "get_weather",
    "",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    strict=True,
)
TIME = Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}})

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def parse_in_pieces(
    convention: Any, pieces: list[str], tools: Any = None
) -> tuple[str, list[tuple[str, Any]]]:
    parser = convention.parser(tools)
    text, calls = "", []
    for piece in pieces:
        t, c = parser.feed(piece)
        text += t
        calls += c
    t, c = parser.flush()
    return text + t, [(call.name, json.loads(call.arguments)) for call in calls + c]


def splits(text: str, n: int) -> list[list[str]]:
    """Every way of cutting ``text`` into n pieces."""
    out = []
    for cuts in itertools.combinations(range(len(text) + 1), n - 1):
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


REPLIES = [
    # (reply, content, calls)
    ("Let me check.\n\n" + CALL_A, "Let me check.", [("get_weather", {"city": "Paris"})]),
    (CALL_A + "\n" + CALL_B, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("No call here, just <tool text.", "No call here, just <tool text.", []),
    ("Before " + CALL_B + " after.", "Before after.", [("get_time", {})]),
    ("<tool_call>\n{not json}\n</tool_call> x", "<tool_call>\n{not json}\n</tool_call> x", []),
    ('<tool_call>\n{"name": "f", "arguments": 3}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": 3}\n</tool_call>', []),
    ("cut <tool_call>\n{\"name\": \"f\"", "cut <tool_call>\n{\"name\": \"f\"", []),
    ("trailing space stays  ", "trailing space stays  ", []),
]


@pytest.mark.parametrize(("reply", "content", "want"), REPLIES)
def test_hermes_parser_at_every_split(reply: str, content: str, want: list[Any]) -> None:
    assert parse_in_pieces(HERMES, [reply]) == (content, want)
    for pieces in splits(reply, 2):
        assert parse_in_pieces(HERMES, pieces) == (content, want), pieces
    for pieces in splits(reply, 3):
        assert parse_in_pieces(HERMES, pieces) == (content, want), pieces


def test_reasoning_and_calls_at_every_byte_offset() -> None:
    """The output chain as the decode loop runs it: bytes, then incremental UTF-8 (as
    StreamDecoder), then the think router, then the hermes parser; cut at every byte pair."""
    reply = (
        "<think>\nZürich 🌤 or Paris?\n</think>\n\nIch prüfe.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌤"}}\n</tool_call>'
    ).encode()
    want = ("Zürich 🌤 or Paris?", "Ich prüfe.", [("get_weather", {"city": "Zürich 🌤"})])
    for cuts in itertools.combinations(range(1, len(reply)), 2):
        utf8 = codecs.getincrementaldecoder("utf-8")()
        router, parser = ThinkRouter(ThinkMarkers()), HERMES.parser()
        reasoning, text, calls = "", "", []
        for a, b in itertools.pairwise([0, *cuts, len(reply)]):
            r, t = router.feed(utf8.decode(reply[a:b]))
            t, c = parser.feed(t)
            reasoning, text, calls = reasoning + r, text + t, calls + c
        r, t = router.flush()
        t, c = parser.feed(t)
        tail, more = parser.flush()
        got = (reasoning + r, text + t + tail, [(x.name, json.loads(x.arguments)) for x in calls + c + more])
        assert got == want, cuts


def test_hermes_parser_holds_back_only_what_may_be_a_marker() -> None:
    parser = HERMES.parser()
    assert parser.feed("Hello <tool") == ("Hello", [])  # "<tool" and the space wait
    assert parser.feed("box> done") == (" <toolbox> done", [])


def test_hermes_reads_quoted_arguments_and_keeps_ids_unique() -> None:
    reply = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>' * 2
    parser = HERMES.parser()
    text, calls = parser.feed(reply)
    assert text == "" and [json.loads(c.arguments) for c in calls] == [{"a": 1}, {"a": 1}]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_json_call_parser_takes_one_object_or_returns_text() -> None:
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for pieces in splits(body, 2):
        assert parse_in_pieces(JSON_CALL, pieces) == ("", [("get_weather", {"city": "Paris"})])
    assert parse_in_pieces(JSON_CALL, ["Sorry, no."]) == ("Sorry, no.", [])


# ---------------------------------------------------------------------------- grammars


class ByteVocab:
    """A vocabulary of single bytes (and an EOS), so a grammar can be walked byte by byte."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return list(data)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocab()))


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    for byte in text.encode():
        if not matcher.consume_token(byte):
            return False
    return bool(matcher.is_accepting())


def test_hermes_grammar_accepts_exactly_calls_of_the_allowed_tools(tokenizer: Any) -> None:
    grammar = forced_call_grammar(HERMES, [WEATHER, TIME])
    assert accepts(tokenizer, grammar, CALL_A)
    assert accepts(tokenizer, grammar, CALL_A + "\n" + CALL_B)  # parallel by default
    assert not accepts(tokenizer, grammar, "Sure. " + CALL_A)
    assert not accepts(tokenizer, grammar, CALL_A.replace("get_weather", "rm_rf"))
    # a strict schema is enforced: the required argument, its type, no invented keys
    assert not accepts(tokenizer, grammar, CALL_A.replace('{"city": "Paris"}', "{}"))
    assert not accepts(tokenizer, grammar, CALL_A.replace('"Paris"', "3"))
    assert not accepts(tokenizer, grammar, CALL_A.replace('"Paris"}', '"Paris", "x": 1}'))


def test_forced_grammar_for_one_named_tool_and_one_call(tokenizer: Any) -> None:
    grammar = forced_call_grammar(HERMES, [WEATHER, TIME], only="get_time", parallel=False)
    assert accepts(tokenizer, grammar, CALL_B)
    assert not accepts(tokenizer, grammar, CALL_A)
    assert not accepts(tokenizer, grammar, CALL_B + "\n" + CALL_B)
    with pytest.raises(ValueError, match="no declared tool named 'nope'"):
        forced_call_grammar(HERMES, [WEATHER], only="nope")


def test_json_call_grammar_is_one_bare_object(tokenizer: Any) -> None:
    grammar = forced_call_grammar(JSON_CALL, [WEATHER, TIME])
    assert accepts(tokenizer, grammar, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert accepts(tokenizer, grammar, '{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert not accepts(tokenizer, grammar, CALL_A)
    assert not accepts(tokenizer, grammar, '{"name": "get_time"}')


# ---------------------------------------------------------------------------- cut off


def cut_at(convention: Any, text: str, tools: Any) -> tuple[str, list[Any]]:
    parser = convention.parser(tools)
    shown, calls = parser.feed(text)
    rest, more = parser.cut()
    return shown + rest, calls + more


@pytest.mark.parametrize(
    ("convention", "reply", "arguments"),
    [
        (HERMES, "Let me check.\n\n" + CALL_A, '{"city": "Paris"}'),
        (JSON_CALL, CALL_A.split("\n")[1], '{"city": "Paris"}'),
        (
            QWEN_XML,
            "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa\"ris\n"
            "</parameter>\n</function>\n</tool_call>",
            '{"city": "Pa\\"ris"}',
        ),
    ],
    ids=["hermes", "json", "qwen_xml"],
)
def test_a_reply_cut_off_anywhere_shows_no_call_notation(
    convention: Any, reply: str, arguments: str
) -> None:
    """Cut at every character: the text before the call is content, the call is a call
    (partial, its arguments the JSON so far) or nothing, never text."""
    lead = "" if convention is JSON_CALL else "Let me check."
    for end in range(len(reply) + 1):
        text, calls = cut_at(convention, reply[:end], [WEATHER, TIME])
        # (cut in the whitespace after the text, the reply keeps it)
        assert lead.startswith(text.rstrip()) and (text == lead or not calls), (end, text)
        assert len(calls) <= 1, end
        for call in calls:
            assert call.name == "get_weather"
            assert arguments.startswith(call.arguments), (end, call.arguments)
            assert call.partial or call.arguments == arguments
    # whole but for the closing marker (or the object's last brace), a call is whole
    _, [call] = cut_at(convention, reply[:-1 if convention is JSON_CALL else -3], [WEATHER, TIME])
    assert call.arguments == arguments


def test_a_cut_call_names_its_tool_once_only_one_fits() -> None:
    head = '<tool_call>\n{"name": "get_'
    assert cut_at(HERMES, head, [WEATHER, TIME]) == ("", [])  # either tool
    [call] = cut_at(HERMES, head + "t", [WEATHER, TIME])[1]
    assert (call.name, call.arguments, call.partial) == ("get_time", "", True)
    [call] = cut_at(HERMES, "<tool_call>\n", [WEATHER])[1]  # the only tool
    assert call.name == "get_weather"
    assert cut_at(HERMES, head + "t", None) == ("", [])  # tools unknown: no guess
    # a region that is no call, and an opening marker begun, are dropped
    assert cut_at(HERMES, "Hi <tool_call>\nplain words", [WEATHER]) == ("Hi", [])
    assert cut_at(HERMES, "Hi <tool_c", [WEATHER]) == ("Hi", [])
    # whitespace held back at the cut is still the reply's
    assert cut_at(HERMES, "Hi  ", [WEATHER]) == ("Hi  ", [])


def test_a_cut_xml_call_types_the_parameters_written_whole() -> None:
    tool = Tool("f", "", {"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}}})
    body = ("<tool_call>\n<function=f>\n<parameter=n>\n12\n</parameter>\n"
            "<parameter=o>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=s>\nline\none\n</param")
    [call] = cut_at(QWEN_XML, body, [tool])[1]
    assert call.arguments == '{"n": 12, "o": {"a": [1, 2]}, "s": "line\\none'
    [call] = cut_at(QWEN_XML, body[: body.index("[1")], [tool])[1]
    assert call.arguments == '{"n": 12, "o": {"a": '
    # a function no tool declares is no call
    assert cut_at(QWEN_XML, "<tool_call>\n<function=g>\n", [tool]) == ("", [])


def test_closed_schema_closes_objects_that_do_not_open_themselves() -> None:
    from lmserve_core.tools import closed_schema

    item = {"type": "object", "properties": {"x": {}}}
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": item},
            "choice": {"anyOf": [item, {"type": "null"}]},
            "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "loose": {"type": "object"},
            "properties": item,  # a property so named is still a property
            "both": {"allOf": [item, {"properties": {"z": {}}}]},
            "const": {"const": {"properties": {}}},
        },
        "$defs": {"D": item},
    }
    out = closed_schema(schema)
    closed = {**item, "additionalProperties": False}
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["list"]["items"] == closed and props["choice"]["anyOf"][0] == closed
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["loose"]
    assert props["properties"] == closed and set(props) == set(schema["properties"])
    # the parts of an allOf each name some of the keys: left open
    assert props["both"] == schema["properties"]["both"]
    assert props["const"] == {"const": {"properties": {}}}  # a value, not a schema
    assert out["$defs"]["D"] == closed
    assert schema["properties"]["list"]["items"] == item  # the input is left as it was
