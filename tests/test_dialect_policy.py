"""The capability policy shared by the three chat dialects: the same problem is the same
error (status, code, wording apart from the field's name) in each of them, and the same
request means the same thing to the backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from processes import API_KEY, RunningServer, launch

from lmserve_core.backend import Capabilities
from lmserve_core.dialects import anthropic, policy, responses
from lmserve_core.dialects.anthropic_models import MessagesRequest
from lmserve_core.dialects.openai_chat_models import ChatCompletionRequest
from lmserve_core.dialects.openai_translate import chat_request
from lmserve_core.dialects.responses_models import ResponsesRequest
from lmserve_core.errors import InvalidRequest, LmserveError, Unsupported
from lmserve_core.request import Constraint, Tool, ToolChoice, ToolChoiceMode
from lmserve_core.tools import HERMES

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ALL_CAPS = Capabilities(grammar=True, reasoning=True, tools=HERMES)
NO_GRAMMAR = Capabilities(reasoning=True, tools=HERMES)
GRAMMAR_ONLY = Capabilities(grammar=True)
REFUSES = Capabilities(reasoning=True, refuses_tools="this model writes a block at a time")
DIALECTS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def base(dialect: str, text: str = "hi") -> dict[str, Any]:
    if dialect == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": text}]}
    if dialect == "responses":
        return {"model": "m", "input": text}
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": text}]}


def tools(dialect: str) -> list[dict[str, Any]]:
    if dialect == "chat":
        return [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    if dialect == "responses":
        return [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    return [{"name": "get_weather", "input_schema": SCHEMA}]


def forced(dialect: str, name: str | None = None) -> Any:
    if dialect == "chat":
        return "required" if name is None else {"type": "function", "function": {"name": name}}
    if dialect == "responses":
        return "required" if name is None else {"type": "function", "name": name}
    return {"type": "any"} if name is None else {"type": "tool", "name": name}


def json_format(dialect: str) -> dict[str, Any]:
    fmt = {"type": "json_schema", "schema": SCHEMA}
    if dialect == "chat":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "o", "schema": SCHEMA},
            }
        }
    if dialect == "responses":
        return {"text": {"format": {**fmt, "name": "o"}}}
    return {"output_config": {"format": fmt}}


CONSTRAINT_FIELD = {
    "chat": "response_format",
    "responses": "text.format",
    "messages": "output_config.format",
}
CHOICE_FIELD = {"chat": "tool_choice", "responses": "tool_choice", "messages": "tool_choice"}
NAMED_FIELD = {"chat": "tool_choice", "responses": "tool_choice", "messages": "tool_choice.name"}
STOP_FIELD = {"chat": "stop", "responses": "stop", "messages": "stop_sequences"}


@dataclass
class Problem:
    """One problem spelled in each dialect: the body, and the dialect's fields it names."""

    name: str
    caps: Capabilities
    status: int

    def body(self, dialect: str) -> dict[str, Any]:
        body = base(dialect)
        if self.name == "forced call without grammar":
            body.update(tools=tools(dialect), tool_choice=forced(dialect))
        elif self.name == "named tool not declared":
            body.update(tools=tools(dialect), tool_choice=forced(dialect, "nope"))
        elif self.name == "tools refused":
            body.update(tools=tools(dialect))
        elif self.name == "forced call refused":
            body.update(tools=tools(dialect), tool_choice=forced(dialect, "get_weather"))
        elif self.name == "forced call without tools":
            body.update(tool_choice=forced(dialect))
        elif self.name in ("constraint without grammar", "constraint refused"):
            body.update(json_format(dialect))
        elif self.name == "stop strings unsupported":
            body[STOP_FIELD[dialect]] = ["END"]
        elif self.name == "no system role":
            if dialect == "chat":
                body["messages"].insert(0, {"role": "system", "content": "s"})
            elif dialect == "responses":
                body["instructions"] = "s"
            else:
                body["system"] = "s"
        return body

    def fields(self, dialect: str) -> list[str]:
        """The fields its message names, longest first (so replacing them is unambiguous)."""
        if self.name == "named tool not declared":
            return [NAMED_FIELD[dialect]]
        if self.name in ("constraint without grammar", "constraint refused"):
            return [CONSTRAINT_FIELD[dialect]]
        if self.name in ("tools refused", "forced call refused"):
            return ["tools"]
        if self.name == "stop strings unsupported":
            return [STOP_FIELD[dialect]]
        if self.name == "no system role":
            return [
                {"chat": "messages[0].role", "responses": "instructions", "messages": "system"}[
                    dialect
                ]
            ]
        return [CHOICE_FIELD[dialect]]

    def neutral(self, dialect: str, message: str) -> str:
        for i, field in enumerate(sorted(self.fields(dialect), key=len, reverse=True)):
            assert f"'{field}'" in message, (field, message)
            message = message.replace(f"'{field}'", f"'<field {i}>'")
        return message


PROBLEMS = [
    Problem("forced call without grammar", NO_GRAMMAR, 501),
    Problem("forced call without grammar", Capabilities(), 501),
    Problem("named tool not declared", ALL_CAPS, 400),
    Problem("forced call without tools", ALL_CAPS, 400),
    Problem("constraint without grammar", NO_GRAMMAR, 501),
    Problem("stop strings unsupported", Capabilities(stop_strings=False), 501),
    Problem("no system role", Capabilities(system_role=False), 400),
    Problem("tools refused", REFUSES, 400),
    Problem("forced call refused", REFUSES, 400),
    Problem("constraint refused", REFUSES, 400),
]


def translate(dialect: str, body: dict[str, Any], caps: Capabilities) -> Any:
    server: Any = SimpleNamespace(
        backend=SimpleNamespace(capabilities=caps), ctx=4096, model_id="m"
    )
    if dialect == "chat":
        return chat_request(msgspec.convert(body, ChatCompletionRequest), caps, 4096, "id")
    if dialect == "responses":
        return responses.translate(msgspec.convert(body, ResponsesRequest), server).normalized
    return anthropic.translate(msgspec.convert(body, MessagesRequest), server)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.name}-{p.status}")
def test_same_problem_same_error_in_every_translator(problem: Problem) -> None:
    seen: dict[str, tuple[int, str | None, str, type]] = {}
    for dialect in DIALECTS:
        with pytest.raises(LmserveError) as info:
            translate(dialect, problem.body(dialect), problem.caps)
        err = info.value
        assert err.param == problem.fields(dialect)[-1]
        seen[dialect] = (err.status, err.code, problem.neutral(dialect, err.message), type(err))
    assert seen["chat"][0] == problem.status
    assert seen["chat"] == seen["responses"] == seen["messages"]


# -- through the three envelopes ------------------------------------------------------------


@pytest.fixture(scope="module")
def no_grammar_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = launch(
        env={"LMSERVE_SCRIPTED_CAPS": "tools,reasoning"}, log_dir=tmp_path_factory.mktemp("ng")
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def grammar_only_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = launch(
        env={"LMSERVE_SCRIPTED_CAPS": "grammar"}, log_dir=tmp_path_factory.mktemp("go")
    )
    yield running
    running.stop()


def post(server: RunningServer, dialect: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "anthropic-version": "2023-06-01"}
    return httpx.post(server.base_url + PATHS[dialect], json=body, headers=headers, timeout=30)


WIRE_PROBLEMS = [p for p in PROBLEMS if p.caps in (ALL_CAPS, NO_GRAMMAR)]


@pytest.mark.parametrize("problem", WIRE_PROBLEMS, ids=lambda p: f"{p.name}-{p.status}")
def test_same_problem_same_error_in_every_envelope(
    problem: Problem, server: RunningServer, no_grammar_server: RunningServer
) -> None:
    target = server if problem.caps is ALL_CAPS else no_grammar_server
    messages = {}
    for dialect in DIALECTS:
        response = post(target, dialect, problem.body(dialect))
        assert response.status_code == problem.status, response.text
        body = response.json()
        if dialect == "messages":
            assert body["type"] == "error"
            error = body["error"]
            assert error["type"] == "invalid_request_error"
        else:
            error = body["error"]
            assert error["param"] == problem.fields(dialect)[-1]
            assert error["type"] == "invalid_request_error"
        messages[dialect] = problem.neutral(dialect, error["message"])
    assert messages["chat"] == messages["responses"] == messages["messages"]


def echoed(dialect: str, response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    body = response.json()
    if dialect == "chat":
        text = body["choices"][0]["message"]["content"]
    elif dialect == "responses":
        text = body["output"][0]["content"][0]["text"]
    else:
        text = body["content"][0]["text"]
    return json.loads(text)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_forced_call_on_a_backend_without_a_convention(
    dialect: str, grammar_only_server: RunningServer
) -> None:
    body = {**base(dialect, "#echo"), "tools": tools(dialect), "tool_choice": forced(dialect)}
    got = echoed(dialect, post(grammar_only_server, dialect, body))
    assert got["tool_choice"] == {"mode": "required", "name": None}
    assert [t["name"] for t in got["tools"]] == ["get_weather"]
    body["tool_choice"] = forced(dialect, "get_weather")
    got = echoed(dialect, post(grammar_only_server, dialect, body))
    assert got["tool_choice"] == {"mode": "named", "name": "get_weather"}
    # under auto the tools are dropped: nothing in a free reply could be read as a call
    del body["tool_choice"]
    got = echoed(dialect, post(grammar_only_server, dialect, body))
    assert got["tools"] == [] and got["tool_choice"]["mode"] == "auto"
    assert "tools_dropped" in grammar_only_server.log_text()


@pytest.mark.parametrize("dialect", DIALECTS)
def test_same_request_same_decision(dialect: str, server: RunningServer) -> None:
    body = {**base(dialect, "#echo"), "tools": tools(dialect)}
    switch = {
        "chat": {"reasoning_effort": "high"},
        "responses": {"reasoning": {"effort": "high"}},
        "messages": {"thinking": {"type": "enabled", "budget_tokens": 2000}},
    }[dialect]
    got = echoed(dialect, post(server, dialect, {**body, **switch}))
    assert got["reasoning"] is True and got["tool_choice"]["mode"] == "auto"
    assert got["parallel_tool_calls"] is True
    # a constraint turns reasoning off
    got = echoed(
        dialect, post(server, dialect, {**base(dialect, "#echo"), **switch, **json_format(dialect)})
    )
    assert got["reasoning"] is False and got["constraint"]["kind"] == "json_schema"
    assert got["reasoning_budget"] is None
    # so does a forced call
    got = echoed(dialect, post(server, dialect, {**body, **switch, "tool_choice": forced(dialect)}))
    assert got["reasoning"] is False and got["tool_choice"]["mode"] == "required"
    # a forced call and an output schema are independent: both reach the backend
    forced_json = {**body, **json_format(dialect), "tool_choice": forced(dialect)}
    got = echoed(dialect, post(server, dialect, forced_json))
    assert got["tool_choice"]["mode"] == "required" and got["reasoning"] is False
    assert got["constraint"]["kind"] == "json_schema"
    assert [t["name"] for t in got["tools"]] == ["get_weather"]
    # none hides the tools
    none = {"chat": "none", "responses": "none", "messages": {"type": "none"}}[dialect]
    got = echoed(dialect, post(server, dialect, {**body, "tool_choice": none}))
    assert got["tools"] == [] and got["tool_choice"]["mode"] == "none"
    # one call per reply
    single = {
        "chat": {"parallel_tool_calls": False},
        "responses": {"parallel_tool_calls": False},
        "messages": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    }[dialect]
    got = echoed(dialect, post(server, dialect, {**body, **single}))
    assert got["parallel_tool_calls"] is False and len(got["tools"]) == 1


@pytest.mark.parametrize("caps", [ALL_CAPS, GRAMMAR_ONLY], ids=["convention", "no-convention"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_forced_call_goes_with_an_output_constraint(dialect: str, caps: Capabilities) -> None:
    """The tool choice governs the turn's calls, the output constraint its text: a forced
    call with an output schema (the OpenAI Agents SDK's output_type with tool_choice
    "required", instructor's tools modes) is one request, not a 400."""
    for name in (None, "get_weather"):
        body = {**base(dialect), **json_format(dialect), "tools": tools(dialect),
                "tool_choice": forced(dialect, name)}
        request = translate(dialect, body, caps)
        assert request.tool_choice.mode is (
            ToolChoiceMode.REQUIRED if name is None else ToolChoiceMode.NAMED
        )
        assert [t.name for t in request.tools] == ["get_weather"]
        assert request.constraint is not None and request.constraint.kind == "json_schema"
        assert request.reasoning is False
    if dialect != "messages":  # lmserve's own constraint fields
        body = {**base(dialect), "tools": tools(dialect), "tool_choice": forced(dialect),
                "regex": "[a-z]+"}
        assert translate(dialect, body, caps).constraint.kind == "regex"


def test_reasoning_without_a_reasoning_mode_is_the_one_strict_switch() -> None:
    """The deliberate difference: chat's reasoning_effort promises reasoning (400 where there
    is none); Responses' reasoning.effort and Anthropic's thinking are no-ops there."""
    plain = Capabilities()
    with pytest.raises(InvalidRequest) as info:
        translate("chat", {**base("chat"), "reasoning_effort": "high"}, plain)
    assert info.value.param == "reasoning_effort"
    kwargs = {**base("chat"), "chat_template_kwargs": {"enable_thinking": True}}
    assert translate("chat", kwargs, plain).reasoning is False
    resp = translate("responses", {**base("responses"), "reasoning": {"effort": "high"}}, plain)
    assert resp.reasoning is False
    thinking = {"type": "enabled", "budget_tokens": 2000}
    msg = translate("messages", {**base("messages"), "thinking": thinking}, plain)
    assert msg.reasoning is False and msg.reasoning_budget is None


# -- the policy on its own --------------------------------------------------------------------


def test_decide_orders_its_checks() -> None:
    tool = Tool("f", parameters={"type": "object"})
    ask = policy.ToolAsk([tool], ToolChoice(ToolChoiceMode.REQUIRED))
    regex = [("regex", Constraint("regex", "a"))]
    # with no grammar, the constraint's own 501 comes first
    with pytest.raises(Unsupported) as unsupported:
        policy.decide(Capabilities(tools=HERMES), tools=ask, constraints=regex)
    assert unsupported.value.param == "regex"
    # two constraints: the second is named
    two = [*regex, ("lark", Constraint("lark", "start: /a/"))]
    with pytest.raises(InvalidRequest) as invalid:
        policy.decide(ALL_CAPS, constraints=two)
    assert invalid.value.param == "lark"


def test_decide_defaults_and_apply() -> None:
    decision = policy.decide(ALL_CAPS)
    assert decision.tools == [] and decision.tool_choice.mode is ToolChoiceMode.AUTO
    assert decision.constraint is None and decision.reasoning is False
    ask = policy.ReasoningAsk(True, "thinking", budget=300)
    decision = policy.decide(ALL_CAPS, reasoning=ask)
    assert decision.reasoning is True and decision.reasoning_budget == 300
    request = translate("chat", base("chat"), ALL_CAPS)
    decision.apply(request)
    assert request.reasoning is True and request.reasoning_budget == 300


@pytest.mark.parametrize(
    ("effort", "switch"),
    [(None, None), ("none", False), ("minimal", False), ("low", True), ("max", True)],
)
def test_effort_switch(effort: str | None, switch: bool | None) -> None:
    assert policy.effort_switch(effort, "reasoning_effort") is switch


def test_effort_switch_rejects_unknown_values() -> None:
    with pytest.raises(InvalidRequest) as info:
        policy.effort_switch("extreme", "reasoning.effort")
    assert info.value.param == "reasoning.effort" and "'extreme'" in info.value.message
