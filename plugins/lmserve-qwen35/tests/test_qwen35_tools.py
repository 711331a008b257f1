"""Tool calls and reasoning on synthetic Qwen3.5, Qwen3.5-MoE and Qwen3-Next models, end to
end in the three dialects.

The models have random weights, Qwen3's real tokenizer and, for the Qwen3.5 kinds, Qwen3.5's
real chat template (XML tool calls; with thinking on, the prompt opens the think block);
Qwen3-Next keeps Qwen3's template (hermes JSON calls; the model opens its own think block).
Prompts are compared with what transformers renders from the same template.

Replies are steered as in the Qwen3 tests (``Steer`` of test_qwen3_tools.py): the real hybrid
forward pass runs (DeltaNet states and their checkpoints, KV cache, positions) and the logit of
the next scripted token gets a large bias. Scripts are written as the Qwen3 tests write them,
and the steering here has the model say them as the kind's model would (see ``Steer``): so the
Qwen3 tests run here unchanged, once per kind (they are imported below). The tests written
here are those whose assertions depend on the template (the prompt's end, the notation) and
the cases Qwen3 has no counterpart for.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmserve_core.backend import ServerSettings
from lmserve_core.testing.serving import (
    record_prompts,
    reference_prompt,
    reference_tokenizer,
    serve,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lmserve-qwen3" / "tests"))

import test_qwen3_tools as q3  # noqa: E402
from test_qwen3_tools import (  # noqa: E402, F401 (tests collected here, once per kind)
    test_a_call_region_that_is_not_json_passes_through_as_text,
    test_a_think_block_written_with_reasoning_off_stays_out_of_the_answer,
    test_count_tokens_counts_thinking_history_as_the_template_renders_it,
    test_forced_call_is_a_valid_call_of_an_allowed_tool,
    test_forced_call_switches_reasoning_off,
    test_forced_call_through_the_anthropic_stream_helper,
    test_forced_call_through_the_openai_chat_stream_helper,
    test_forced_call_through_the_openai_responses_stream_helper,
    test_reasoning_off_renders_the_primed_empty_think_block,
    test_reasoning_through_the_sdk_stream_helpers,
    test_thinking_budget_closes_the_think_block_and_the_answer_follows,
    test_two_call_regions_are_two_calls_unless_parallel_calls_are_off,
)

from lmserve_core import tools  # noqa: E402

KINDS = ("qwen35", "qwen35moe", "qwen3next")
QWEN35_TEMPLATE = {"qwen35": True, "qwen35moe": True, "qwen3next": False}
OPENER = "<|im_start|>assistant\n"
PRIMED = "<think>\n\n</think>\n\n"  # the empty think block of thinking off
BASE = "http://testserver"  # the in-process server's address, for the SDKs
END = "<|im_end|>"

srv = q3.srv  # the fixture: ``served`` with the steering and the recorded prompts reset


def xml_call(name: str, arguments: dict[str, Any]) -> str:
    """A call region as Qwen3.5's template writes one: string values as they are, the others
    as JSON."""
    params = "".join(
        f"<parameter={key}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
        "\n</parameter>\n"
        for key, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _in_xml(region: re.Match[str]) -> str:
    try:
        call = json.loads(region[1])
        return xml_call(call["name"], call["arguments"])
    except (ValueError, TypeError, KeyError):
        return region[0]  # no call: said as it is


class Steer(q3.Steer):
    """Qwen3's steering, with a script (written as the Qwen3 tests write one) said as the
    kind's model says it:

    - on the Qwen3.5 kinds, each call region (hermes JSON in the script) in the XML notation
      their template teaches; a region that is no call stays as it is;
    - where the prompt ends by opening the think block (Qwen3.5's template, thinking on), the
      model goes on from there: the ``<think>\\n`` a script opens with is not said again;
    - the tool-call markers as the special tokens they are. Under a forced call's grammar they
      may also be spelled with ordinary tokens ("<", "/tool", "_call", ">\\n"), and a random
      model sometimes does: its ">\\n" then commits it to a further call. A trained model
      writes the special tokens; this bias (below the script's, above the random logits)
      makes the synthetic one do the same.
    """

    MARKER_BIAS = 50.0

    def __init__(self, backend: Any, xml: bool) -> None:
        super().__init__(backend)
        self.xml = xml
        self.markers = [backend.tokenizer.token_id(m) for m in ("<tool_call>", "</tool_call>")]
        self.opener = self.ids("<think>\n")
        prefill, n = backend.scheduler.prefill_some, len(self.opener)

        def going_on(gen: Any, shared: bool) -> None:
            opened = gen.prepared.tokens[-n:] == self.opener
            if gen.slot is None and opened and self.script[:n] == self.opener:
                self.script = self.script[n:]
            prefill(gen, shared)

        backend.scheduler.prefill_some = going_on

    def say(self, text: str, then: str | None = None) -> None:
        super().say(self.spoken(text), None if then is None else self.spoken(then))

    def spoken(self, text: str) -> str:
        if not self.xml:
            return text
        return re.sub(r"<tool_call>\n(.*?)\n</tool_call>", _in_xml, text, flags=re.S)

    def _bias(self, logits: Any) -> Any:
        out = super()._bias(logits)
        out[self.markers] += self.MARKER_BIAS
        return out


@dataclass
class Served(q3.Served):
    kind: str = "qwen35"
    convention: Any = None  # the backend's tool convention

    @property
    def qwen35(self) -> bool:
        """Qwen3.5's template: XML calls, thinking opened in the prompt."""
        return QWEN35_TEMPLATE[self.kind]

    def written(self) -> str:
        """The text of the tokens the model was fed while decoding the last reply."""
        return self.steer.tokenizer.decode([t for step in self.steer.steps for t in step])


@pytest.fixture(scope="module", params=KINDS)
def served(request: pytest.FixtureRequest, synthetic: Any) -> Iterator[Served]:
    from lmserve_qwen35.plugin import create_backend

    kind = request.param
    settings = ServerSettings(ctx=2048, threads=2)
    backend = create_backend(str(synthetic(kind, "q8_0").gguf), settings)
    steer = Steer(backend, xml=QWEN35_TEMPLATE[kind])
    prompts = record_prompts(backend)
    with serve(backend, settings) as http, q3.httpx2.Client(transport=q3._Bridge(http)) as bridge:
        sdk = {"api_key": "x", "max_retries": 0}
        yield Served(
            http,
            steer,
            prompts,
            kind=kind,
            convention=backend.capabilities.tools,
            openai=q3.openai.OpenAI(base_url=f"{BASE}/v1", http_client=http, **sdk),
            anthropic=q3.anthropic.Anthropic(base_url=BASE, http_client=bridge, **sdk),
        )


@functools.cache
def _reference_tokenizer(hf_dir: Path) -> Any:
    return reference_tokenizer(hf_dir)


@pytest.fixture
def hf_tokenizer(srv: Served, synthetic: Any) -> Any:
    return _reference_tokenizer(synthetic(srv.kind, "q8_0").hf_dir)


def cases_of(test: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a test with the marks (parametrization included) of the Qwen3 ``test``."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.pytestmark = list(test.pytestmark)  # type: ignore[attr-defined]
        return fn

    return decorate


# ---------------------------------------------------------------------------- 0. conventions


def test_the_template_picks_the_tool_notation(srv: Served) -> None:
    assert srv.convention is (tools.QWEN_XML if srv.qwen35 else tools.HERMES)


def test_the_steering_says_the_script_in_the_kinds_notation(srv: Served) -> None:
    srv.steer.say(q3.TWO_CALLS + END)
    regions = [xml_call(name, args) for name, args in q3.TWO_CALLS_PARSED]
    script = "\n".join(regions) + END if srv.qwen35 else q3.TWO_CALLS + END
    assert srv.steer.tokenizer.decode(srv.steer.script) == script


# ---------------------------------------------------------------------------- 1. prompts


@cases_of(q3.test_prompt_with_tool_history_is_what_transformers_renders)
def test_prompt_with_tool_history_is_what_transformers_renders(
    srv: Served, hf_tokenizer: Any, dialect: str, switch: str, on: bool, loop: bool
) -> None:
    srv.post(dialect, q3.history_body(dialect, switch, on, loop))
    history = q3.reference_messages(dialect, loop)
    declared = [q3.chat_tool(name) for name in q3.SCHEMAS]
    text = reference_prompt(hf_tokenizer, history, tools=declared, thinking=on)
    assert srv.prompts == [(text, hf_tokenizer.encode(text, add_special_tokens=False))]
    # thinking on: Qwen3.5's template opens the block, Qwen3's leaves it to the model
    assert text.endswith(OPENER + (srv.qwen35 * "<think>\n" if on else PRIMED))
    # only inside a tool loop do the templates replay the turn's reasoning
    assert (f"<think>\n{q3.REASONING}\n</think>" in text) == loop
    # the history's calls in the template's notation, their results as tool responses
    calls = "\n".join(
        xml_call(name, args)
        if srv.qwen35
        else f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}"
        "\n</tool_call>"
        for _, name, args in q3.CALLS
    )
    assert calls in text
    assert all(f"<tool_response>\n{r}\n</tool_response>" in text for r in q3.RESULTS[dialect])


DEVELOPER = "Sandbox: read-only. Ask before writing files."


@pytest.mark.parametrize("dialect", ["chat", "responses"])
def test_instructions_and_developer_messages_open_the_prompt(
    srv: Served, request: pytest.FixtureRequest, dialect: str
) -> None:
    # Codex's requests: instructions, then a developer message, then the user's turn; Qwen3's
    # template renders each system message as a block of its own, Qwen3.5's accepts one and
    # gets them joined
    srv.steer.say("the answer" + END)
    if dialect == "chat":
        roles = [("system", q3.SYSTEM), ("developer", DEVELOPER), ("user", q3.ASK)]
        body = {"messages": [{"role": r, "content": c} for r, c in roles], "max_tokens": 8}
    else:
        roles = [("developer", DEVELOPER), ("user", q3.ASK)]
        items = [{"type": "message", "role": r, "content": c} for r, c in roles]
        body = {"instructions": q3.SYSTEM, "input": items, "max_output_tokens": 8}
    reply = srv.http.post(q3.PATHS[dialect], json={"model": srv.kind, **body})
    assert reply.status_code == 200, reply.text
    # both instructions in the prompt, ahead of the user's turn
    head = srv.prompt.split("<|im_start|>user\n")[0]
    assert q3.SYSTEM in head and DEVELOPER in head
    assert q3.READERS[dialect](reply.json()).text == "the answer"


# ---------------------------------------------------------------------------- 2. calls


@pytest.mark.parametrize("choice", ["required", "get_time"])
@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_forced_call_is_written_in_the_templates_notation(
    srv: Served, dialect: str, choice: str
) -> None:
    srv.steer.always = srv.steer.ids(END)[0]
    reply = srv.ask(dialect, tools=list(q3.SCHEMAS), choice=choice, max_tokens=80)
    ((name, arguments),) = reply.calls
    assert choice in ("required", name)
    # what the grammar made the model write is one call region of the template's notation,
    # the one the reply reports
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    assert srv.written() == srv.steer.spoken(f"<tool_call>\n{call}\n</tool_call>")
    assert reply.finish == q3.CALLED[dialect]


# Values of other types than strings come back typed by the parameter's schema: in the XML
# notation they are bare text between the tags.
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string"},
    },
    "required": ["city", "days"],
}
FORECAST_ARGS = {
    "city": "São Paulo",
    "days": 3,
    "hourly": True,
    "fields": ["rain", "wind"],
    "note": "two lines:\nrain, then wind",
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_call_arguments_come_back_typed_by_the_schema(
    srv: Served, monkeypatch: pytest.MonkeyPatch, dialect: str, stream: bool
) -> None:
    monkeypatch.setitem(q3.SCHEMAS, "get_forecast", FORECAST)
    monkeypatch.setitem(q3.DESCRIPTIONS, "get_forecast", "The forecast for a city.")
    call = json.dumps({"name": "get_forecast", "arguments": FORECAST_ARGS}, ensure_ascii=False)
    srv.steer.say(f"<tool_call>\n{call}\n</tool_call>{END}")
    reply = srv.ask(dialect, tools=list(q3.SCHEMAS), max_tokens=120, stream=stream)
    assert reply.calls == [("get_forecast", FORECAST_ARGS)]
    assert (reply.text, reply.finish) == ("", q3.CALLED[dialect])


UNDECLARED = (
    "<tool_call>\n<function=get_news>\n<parameter=topic>\nrain\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_a_call_of_an_undeclared_tool_passes_through_as_text(
    srv: Served, dialect: str, stream: bool
) -> None:
    if not srv.qwen35:
        pytest.skip("the hermes parser reads a call of any name (see test_qwen3_tools.py)")
    srv.steer.say(UNDECLARED + END)
    reply = srv.ask(dialect, tools=list(q3.SCHEMAS), max_tokens=80, stream=stream)
    assert (reply.text, reply.calls) == (UNDECLARED, [])
    assert reply.finish == q3.ANSWERED[dialect]


# ---------------------------------------------------------------------------- 3. thinking


@cases_of(q3.test_reasoning_comes_back_in_the_dialects_reasoning_field)
def test_reasoning_comes_back_in_the_dialects_reasoning_field(
    srv: Served, dialect: str, stream: bool
) -> None:
    srv.steer.say(q3.THOUGHT + END)
    reply = srv.ask(dialect, thinking=True, stream=stream)
    # Qwen3.5's prompt opens the block and the reply's text up to </think> is reasoning;
    # Qwen3's model opens it itself
    assert srv.prompt.endswith(OPENER + srv.qwen35 * "<think>\n")
    said = srv.steer.tokenizer.decode(srv.steer.script)
    assert said == q3.THOUGHT.removeprefix(srv.qwen35 * "<think>\n") + END
    assert (reply.reasoning, reply.text) == ("some reasoning", "the answer")
    assert (reply.finish, reply.completion_tokens) == (
        q3.ANSWERED[dialect],
        len(srv.steer.script),
    )
    if dialect == "messages":
        assert reply.signatures and set(reply.signatures) == {""}
    else:  # at least the reasoning's own tokens, at most the whole think block
        block = srv.steer.script[: srv.steer.script.index(srv.steer.close_id) + 1]
        assert reply.reasoning_tokens is not None
        assert len(srv.steer.ids("some reasoning")) <= reply.reasoning_tokens <= len(block)
    if stream:
        assert q3.REASONING_EVENTS[dialect] <= reply.events


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_a_call_after_reasoning_is_a_call_and_the_reasoning_is_reasoning(
    srv: Served, dialect: str, stream: bool
) -> None:
    (name, args), _ = q3.TWO_CALLS_PARSED
    call = json.dumps({"name": name, "arguments": args})
    srv.steer.say(f"<think>\nI should look it up.\n</think>\n\n<tool_call>\n{call}\n</tool_call>{END}")
    reply = srv.ask(dialect, tools=list(q3.SCHEMAS), thinking=True, max_tokens=100, stream=stream)
    assert (reply.reasoning, reply.text) == ("I should look it up.", "")
    assert reply.calls == [(name, args)]
    assert reply.finish == q3.CALLED[dialect]
    if stream:
        assert (q3.REASONING_EVENTS[dialect] | q3.CALL_EVENTS[dialect]) <= reply.events


LIMITED = {"chat": "length", "responses": "incomplete", "messages": "max_tokens"}


@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_a_reply_cut_inside_the_think_block_is_all_reasoning(srv: Served, dialect: str) -> None:
    srv.steer.say("<think>\n" + q3.LONG_REASONING)
    reply = srv.ask(dialect, thinking=True, max_tokens=8)
    assert (reply.text, reply.calls) == ("", [])
    assert reply.reasoning and q3.LONG_REASONING.startswith(reply.reasoning)
    assert (reply.finish, reply.completion_tokens) == (LIMITED[dialect], 8)


@pytest.mark.parametrize("dialect", q3.DIALECTS)
def test_a_think_block_closed_at_once_is_no_reasoning(srv: Served, dialect: str) -> None:
    srv.steer.say("<think>\n</think>\n\nthe answer" + END)
    reply = srv.ask(dialect, thinking=True)
    assert (reply.reasoning, reply.text) == ("", "the answer")
    assert reply.finish == q3.ANSWERED[dialect]
