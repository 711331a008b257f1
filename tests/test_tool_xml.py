"""The XML tool-call convention of Qwen3.5 and Qwen3-Coder (``QWEN_XML``): the streaming
parser at every split, values typed by the declared schemas, the forced-call grammar
compiled and walked by llguidance, and calls as the chat template writes them in the history
read back; and the marker-region base every region convention streams with."""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import pytest
from test_tools import parse_in_pieces as parse_with
from test_tools import splits

from lmserve_core.chat_template import ChatTemplate, message_dicts, tool_dicts
from lmserve_core.request import Message, Tool, ToolCall
from lmserve_core.tools import (
    HERMES,
    JSON_CALL,
    QWEN_XML,
    MarkerRegionParser,
    forced_call_grammar,
    parse_xml_call,
    xml_value,
)

llguidance = pytest.importorskip("llguidance")

WEATHER = Tool(
    "get_weather",
    "",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
    strict=True,
)
TIME = Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}})
TYPED = Tool(
    "typed",
    "",
    {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]},
            "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "ref": {"$ref": "#/$defs/level"},
            "level": {"enum": [1, 2, 3]},
            "free": {"description": "no type"},
        },
        "$defs": {"level": {"type": "integer"}},
    },
)
TOOLS = [WEATHER, TIME, TYPED]


def xml_call(name: str, **params: str) -> str:
    """A call as the template writes it, each value given as its text."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def inner(region: str) -> str:
    """The text between a region's markers."""
    return region.removeprefix("<tool_call>").removesuffix("</tool_call>")


def parse_in_pieces(
    pieces: list[str], tools: list[Tool] | None = TOOLS
) -> tuple[str, list[tuple[str, Any]]]:
    return parse_with(QWEN_XML, pieces, tools)


def random_splits(text: str, count: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        out.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return out


# ---------------------------------------------------------------------------- parser

CALL_A = xml_call("get_weather", city="Paris", days="3")
CALL_B = xml_call("get_time")
CODE = 'if a < b:\n    print("</tool_call> <function=x>")\n'  # markers inside a value
CALL_CODE = xml_call("get_time", tz=CODE)

REPLIES = [
    # (reply, content, calls)
    (
        "Let me check.\n\n" + CALL_A,
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (CALL_A + "\n" + CALL_B, "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    (CALL_A + CALL_B, "", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("Before " + CALL_B + " after.", "Before after.", [("get_time", {})]),
    (CALL_CODE, "", [("get_time", {"tz": CODE})]),
    ("No call here, just <tool text.", "No call here, just <tool text.", []),
    ("trailing space stays  ", "trailing space stays  ", []),
    # the layout may vary: no newlines, or more of them
    (
        "<tool_call><function=get_weather><parameter=city>Oslo</parameter></function></tool_call>",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "<tool_call>\n\n<function=get_weather>\n\n<parameter=city>\nOslo\n</parameter>\n\n"
        "</function>\n\n</tool_call>",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    # not calls: markers and all come back as text
    ("x " + CALL_A.replace("</function>", ""), "x " + CALL_A.replace("</function>", ""), []),
    (
        CALL_A.replace("<parameter=days>", "junk <parameter=days>"),
        CALL_A.replace("<parameter=days>", "junk <parameter=days>"),
        [],
    ),
    (xml_call("rm_rf", path="/"), xml_call("rm_rf", path="/"), []),  # not a declared tool
    (xml_call(""), xml_call(""), []),
    (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        [],
    ),
    # a <function=...> without the <tool_call> marker is text
    ("<function=get_time>\n</function>", "<function=get_time>\n</function>", []),
    # cut off: an unclosed call, and one whose value never closes (the marker in it is text)
    ("cut <tool_call>\n<function=get_time>\n", "cut <tool_call>\n<function=get_time>\n", []),
    (
        "cut <tool_call>\n<function=get_time>\n<parameter=tz>\nUTC</tool_call> more",
        "cut <tool_call>\n<function=get_time>\n<parameter=tz>\nUTC</tool_call> more",
        [],
    ),
    # a partial marker at the end of the reply
    ("Hello <tool_ca", "Hello <tool_ca", []),
]


@pytest.mark.parametrize(("reply", "content", "want"), REPLIES)
def test_parser_at_every_split(reply: str, content: str, want: list[Any]) -> None:
    assert parse_in_pieces([reply]) == (content, want)
    assert parse_in_pieces(list(reply)) == (content, want)
    for pieces in splits(reply, 2):
        assert parse_in_pieces(pieces) == (content, want), pieces
    for pieces in random_splits(reply, 200, seed=len(reply)):
        assert parse_in_pieces(pieces) == (content, want), pieces


def test_parser_at_every_two_cuts_of_a_reply_with_several_calls() -> None:
    reply = "Two checks.\n\n" + CALL_CODE + "\n" + CALL_A + "\nDone."
    want = (
        "Two checks.\nDone.",
        [("get_time", {"tz": CODE}), ("get_weather", {"city": "Paris", "days": 3})],
    )
    for pieces in splits(reply, 3):
        assert parse_in_pieces(pieces) == want, pieces


def test_parser_holds_back_only_what_may_be_a_marker() -> None:
    parser = QWEN_XML.parser(TOOLS)
    assert parser.feed("Hello <tool") == ("Hello", [])  # "<tool" and the space wait
    assert parser.feed("box> done") == (" <toolbox> done", [])
    assert parser.feed(" <tool_call>\n<function=get_time>\n<parameter=tz>\n</tool_call>") == (
        "",
        [],
    )
    text, calls = parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert text == "" and [json.loads(c.arguments) for c in calls] == [{"tz": "</tool_call>"}]
    assert parser.flush() == ("", [])


def test_calls_get_fresh_ids_and_json_arguments() -> None:
    parser = QWEN_XML.parser(TOOLS)
    text, calls = parser.feed(CALL_A * 2)
    assert text == "" and calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].arguments == '{"city": "Paris", "days": 3}'
    call = parse_xml_call(inner(xml_call("get_time", tz="Zürich 🌤")))
    assert call is not None and call.arguments == '{"tz": "Zürich 🌤"}'  # not \\u-escaped


def test_values_lose_exactly_one_newline_at_each_end() -> None:
    for value in ["", "x", "\nx", "x\n", "\n\nx\n\n", "  x  ", "a\nb"]:
        call = parse_xml_call(inner(xml_call("get_time", tz=value)))
        assert call is not None and json.loads(call.arguments) == {"tz": value}, repr(value)
    # no newline at all is taken as it is
    call = parse_xml_call("<function=get_time><parameter=tz>UTC</parameter></function>")
    assert call is not None and json.loads(call.arguments) == {"tz": "UTC"}


def test_a_repeated_parameter_keeps_its_last_value_and_undeclared_ones_are_kept() -> None:
    reply = xml_call("get_weather", city="Paris").replace(
        "</function>",
        "<parameter=city>\nOslo\n</parameter>\n<parameter=extra>\n[1]\n</parameter>\n</function>",
    )
    assert parse_in_pieces([reply]) == ("", [("get_weather", {"city": "Oslo", "extra": [1]})])


def typed(**values: str) -> dict[str, Any]:
    text, calls = parse_in_pieces([xml_call("typed", **values)])
    assert text == "" and len(calls) == 1
    return calls[0][1]


def test_values_are_typed_by_the_schema() -> None:
    assert typed(text="5", count="5", ratio="2.5", flag="true", nothing="null") == {
        "text": "5",
        "count": 5,
        "ratio": 2.5,
        "flag": True,
        "nothing": None,
    }
    assert typed(where='{"lat": 1.5}', tags='["a", "b"]') == {
        "where": {"lat": 1.5},
        "tags": ["a", "b"],
    }
    assert typed(text='{"lat": 1.5}', tags="[]") == {"text": '{"lat": 1.5}', "tags": []}
    # the template writes booleans and None of the history the Python way
    assert typed(flag="False", nothing="None") == {"flag": False, "nothing": None}
    assert typed(text="True", note="None") == {"text": "True", "note": "None"}
    # what is not JSON (of the admitted types) stays text
    assert typed(count="about 5", ratio="NaN", flag="yes") == {
        "count": "about 5",
        "ratio": "NaN",
        "flag": "yes",
    }
    # a string or more: a JSON value of another admitted type, else the text
    assert typed(note="null", either="7") == {"note": None, "either": 7}
    assert typed(note="7", either="[7]") == {"note": "7", "either": "[7]"}
    assert typed(note='"quoted"') == {"note": '"quoted"'}
    # through $ref and enum; no type at all: JSON, else the text
    assert typed(ref="2", level="3") == {"ref": 2, "level": 3}
    assert typed(free="1e3") == {"free": 1000.0}
    assert typed(free="{bad") == {"free": "{bad"}
    assert typed(free="true") == {"free": True}


def test_xml_value_rules() -> None:
    assert xml_value(" 5 ", {"integer"}) == 5
    assert xml_value("5.0", {"integer", "string"}) == 5.0
    assert xml_value("5.5", {"integer", "string"}) == "5.5"
    assert xml_value('"5"', {"integer"}) == "5"  # JSON it is; the client checks the type
    assert xml_value("[" * 5000, {"array"}) == "[" * 5000
    assert xml_value("Infinity", {"number"}) == "Infinity"


def test_without_tools_any_name_goes_and_values_are_untyped() -> None:
    reply = xml_call("anything", a="5", b="Paris", c="true")
    assert parse_in_pieces([reply], tools=None) == (
        "",
        [("anything", {"a": 5, "b": "Paris", "c": True})],
    )
    assert parse_in_pieces([reply], tools=[]) == (reply, [])  # none declared: no call


def test_every_convention_takes_the_tools() -> None:
    for convention in (HERMES, JSON_CALL, QWEN_XML):
        assert convention.parser(TOOLS).flush() == ("", [])
        assert convention.parser().flush() == ("", [])


# ---------------------------------------------------------------------------- the base


class Angles(MarkerRegionParser):
    """``<<name>>`` regions: a call of ``name``; an empty region is text."""

    def __init__(self) -> None:
        super().__init__("<<", ">>")

    def parse_region(self, body: str) -> ToolCall | None:
        name = body.strip()
        return ToolCall(id="x", name=name, arguments="{}") if name else None


@pytest.mark.parametrize(
    ("reply", "content", "names"),
    [
        ("a <<f>> b <<g>>", "a b", ["f", "g"]),
        ("a\n<< >> b", "a\n<< >> b", []),
        ("a < b >> c <", "a < b >> c <", []),
        ("x <<f", "x <<f", []),
    ],
)
def test_the_base_streams_any_markers(reply: str, content: str, names: list[str]) -> None:
    for pieces in [[reply], list(reply), *splits(reply, 3)]:
        parser = Angles()
        text, calls = "", []
        for piece in pieces:
            t, c = parser.feed(piece)
            text, calls = text + t, calls + c
        t, c = parser.flush()
        assert (text + t, [x.name for x in calls + c]) == (content, names), pieces


# ---------------------------------------------------------------------------- grammars


class ByteVocab:
    """A vocabulary of single bytes (and an EOS), so a grammar can be walked byte by byte."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocab()))


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(b) for b in text.encode()) and bool(matcher.is_accepting())


def test_grammar_accepts_exactly_calls_of_the_allowed_tools(tokenizer: Any) -> None:
    grammar = forced_call_grammar(QWEN_XML, [WEATHER, TIME])
    a = xml_call("get_weather", city="Paris")
    b = xml_call("get_time", tz="Europe/Paris")
    full = xml_call("get_weather", city="Zürich\n🌤 </tool_call>", days="14", unit="celsius")
    for good in [
        a,
        b,
        full,
        xml_call("get_time"),
        a + "\n" + b + "\n" + a,
        xml_call("get_weather", city=""),
    ]:
        assert accepts(tokenizer, grammar, good), good
        text, calls = parse_in_pieces([good])  # and it reads back as calls
        assert text == "" and calls, good
    for wrong in [
        xml_call("get_weather"),  # the required parameter
        xml_call("get_weather", days="3"),
        xml_call("get_weather", city="Paris", days="three"),  # its type
        xml_call("get_weather", city="Paris", days="15"),  # above the maximum
        xml_call("get_weather", city="Paris", days=" 3"),  # the JSON layout
        xml_call("get_weather", city="Paris", unit="kelvin"),  # not in the enum
        xml_call("get_weather", city="Paris", x="1"),  # invented parameters
        xml_call("get_weather", days="3", city="Paris"),  # the schema's order
        xml_call("get_weather", city="a </parameter> b"),  # the closing tag in a string
        xml_call("rm_rf", city="Paris"),
        "Sure. " + a,
        a + b,  # calls one per line
        a + " ",
        a.replace("\n</parameter>", "</parameter>"),
    ]:
        assert not accepts(tokenizer, grammar, wrong), wrong


def test_grammar_for_one_named_tool_and_one_call(tokenizer: Any) -> None:
    grammar = forced_call_grammar(QWEN_XML, [WEATHER, TIME], only="get_time", parallel=False)
    b = xml_call("get_time", tz="UTC")
    assert accepts(tokenizer, grammar, b)
    assert not accepts(tokenizer, grammar, xml_call("get_weather", city="Paris"))
    assert not accepts(tokenizer, grammar, b + "\n" + b)


def test_grammar_types_every_value(tokenizer: Any) -> None:
    grammar = forced_call_grammar(QWEN_XML, [TYPED])
    values = {
        "text": "any\ntext",
        "count": "-3",
        "ratio": "0.5",
        "flag": "false",
        "nothing": "null",
        "where": '{"lat": 1.5}',
        "tags": '["a", "b"]',
        "note": "null",
        "either": "words",
        "ref": "2",
        "level": "3",
        "free": "[1, 2]",
    }
    reply = xml_call("typed", **values)
    assert accepts(tokenizer, grammar, reply)
    assert parse_in_pieces([reply])[1] == [
        (
            "typed",
            {
                "text": "any\ntext",
                "count": -3,
                "ratio": 0.5,
                "flag": False,
                "nothing": None,
                "where": {"lat": 1.5},
                "tags": ["a", "b"],
                "note": None,
                "either": "words",
                "ref": 2,
                "level": 3,
                "free": [1, 2],
            },
        )
    ]
    for key, bad in [
        ("count", "1.5"),
        ("flag", "True"),
        ("where", '{"lat": "x"}'),
        ("tags", "[1]"),
        ("ref", "x"),
        ("level", "4"),
        ("nothing", "None"),
    ]:
        assert not accepts(tokenizer, grammar, xml_call("typed", **{key: bad})), (key, bad)


def test_string_constraints_in_the_grammar(tokenizer: Any) -> None:
    short = Tool(
        "f",
        "",
        {
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 3}},
            "required": ["s"],
        },
        strict=True,
    )
    grammar = forced_call_grammar(QWEN_XML, [short])
    assert accepts(tokenizer, grammar, xml_call("f", s="ab"))
    assert accepts(tokenizer, grammar, xml_call("f", s="🌤🌤🌤"))
    assert not accepts(tokenizer, grammar, xml_call("f", s="a"))
    assert not accepts(tokenizer, grammar, xml_call("f", s="abcd"))
    pattern = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}
    with pytest.raises(ValueError, match="'pattern'"):
        forced_call_grammar(QWEN_XML, [Tool("f", "", pattern, strict=True)])
    lenient = forced_call_grammar(QWEN_XML, [Tool("f", "", pattern)])  # not strict: skipped
    assert accepts(tokenizer, lenient, xml_call("f", s="bbb"))
    mixed = {"type": "object", "properties": {"s": {"type": ["string", "integer"], "minimum": 3}}}
    with pytest.raises(ValueError, match="beyond the type of a free-text parameter"):
        forced_call_grammar(QWEN_XML, [Tool("f", "", mixed, strict=True)])
    optional = {
        "type": "object",
        "properties": {"s": {"type": ["string", "null"]}},
        "required": ["s"],
    }
    grammar = forced_call_grammar(QWEN_XML, [Tool("f", "", optional, strict=True)])
    assert accepts(tokenizer, grammar, xml_call("f", s="null"))
    assert accepts(tokenizer, grammar, xml_call("f", s="text"))
    call = parse_xml_call(inner(xml_call("f", s="null")), {"f": optional})
    assert call is not None and call.arguments == '{"s": null}'
    with pytest.raises(ValueError, match="cannot be written"):
        forced_call_grammar(QWEN_XML, [Tool("bad name", "", {})])
    with pytest.raises(ValueError, match="no declared tool named 'nope'"):
        forced_call_grammar(QWEN_XML, [WEATHER], only="nope")


# ---------------------------------------------------------------------------- the template

CALLS = [
    ("call_1", "get_weather", {"city": "Paris", "days": 2}),
    (
        "call_2",
        "typed",
        {"text": "two\nlines </tool_call>", "flag": True, "tags": ["a"], "nothing": None},
    ),
    ("call_3", "get_time", {}),
]


@pytest.mark.parametrize("name", ["Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"])
def test_rendered_call_history_reads_back_as_the_calls(name: str, tokenizer: Any) -> None:
    from lmserve_core.testing.assets import AssetError
    from lmserve_core.testing.llamacpp import template_path

    try:
        path = template_path(name)  # llama.cpp's copy, fetched once into the test cache
    except AssetError as exc:
        pytest.skip(f"llama.cpp's templates are out of reach: {exc}")
    messages = [
        Message("user", "Weather?"),
        Message(
            "assistant",
            "Let me check.",
            tool_calls=[ToolCall(cid, n, json.dumps(args)) for cid, n, args in CALLS],
        ),
        *(Message("tool", "ok", tool_call_id=cid) for cid, _, _ in CALLS),
    ]
    prompt = ChatTemplate(path.read_text()).render(
        message_dicts(messages), tools=tool_dicts(TOOLS), add_generation_prompt=True
    )
    start = prompt.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    turn = prompt[start : prompt.index("<|im_end|>", start)]
    for pieces in ([turn], list(turn)):
        content, calls = parse_in_pieces(pieces)
        assert calls == [(n, args) for _, n, args in CALLS]
        assert content.strip() == "Let me check." or content.endswith("Let me check.")
    # the grammar accepts a call as the template writes it (parameters in schema order)
    region = re.findall(r"<tool_call>.*?</function>\n</tool_call>", turn, flags=re.S)[0]
    assert accepts(tokenizer, forced_call_grammar(QWEN_XML, TOOLS), region)
