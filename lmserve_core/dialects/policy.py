"""What the served backend can honor: the capability decisions every dialect shares.

A translator parses its own wire fields into normalized pieces — the declared tools and a
tool choice, candidate output constraints, a reasoning switch — and asks :func:`decide` what
they become on this backend. Errors name the dialect's own field (``tool_choice``,
``tool_choice.name``, ``reasoning_effort``, ``text.format``, ``output_config.format``, ...)
and are otherwise the same error (status, code, wording) in every dialect.

The rules:

* ``tool_choice`` none hides the tools from the model.
* auto with tools on a backend without a tool convention drops them (logged
  ``tools_dropped``): the model answers as plain chat, so tool-sending agents stay usable.
* A forced call (any tool, or a named one) compiles to a grammar, so it needs constrained
  decoding (501 without). It does not need a tool convention: the backend then has the
  model write one bare JSON call.
* At most one output constraint per request, and it needs constrained decoding (501). It
  governs the reply's text and the tool choice its calls, independently: with a forced
  call the reply is the call (the constraint has no text to govern), under auto it is
  calls or text of the constraint.
* A model that refuses tools and constraints outright (``Capabilities.refuses_tools``: it
  does not write token by token) makes declared tools (unless the choice is none) and any
  constraint a 400 naming the field.
* A grammar — a constraint or a forced call — governs the reply from its first token, so
  it switches reasoning off. A reasoning switch on a backend without a reasoning mode is a
  no-op, or a 400 where the dialect's field promises reasoning (``ReasoningAsk.strict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import structlog

from ..backend import Capabilities
from ..errors import InvalidRequest, Unsupported
from ..request import Constraint, NormalizedRequest, Tool, ToolChoice, ToolChoiceMode

__all__ = [
    "Decision",
    "ReasoningAsk",
    "ToolAsk",
    "check_stop_strings",
    "check_system_role",
    "decide",
    "declared_tool",
    "effort_switch",
    "is_forced",
    "pick_constraint",
]

log = structlog.get_logger("lmserve.policy")

EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high", "xhigh", "max")
UNSUPPORTED = "unsupported_parameter"


@dataclass(slots=True)
class ToolAsk:
    """The function tools a request declares and how it wants them used."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool = True  # more than one call per reply allowed
    field: str = "tool_choice"  # the dialect's name for the tool choice


@dataclass(slots=True)
class ReasoningAsk:
    """A request's reasoning switch, as the dialect spelled it."""

    on: bool = False
    field: str = ""  # the dialect's name for the switch
    # True: switching reasoning on where the backend has no reasoning mode is a 400;
    # False: it is a no-op.
    strict: bool = False
    budget: int | None = None  # most reasoning tokens, where the dialect has such a field


@dataclass(slots=True)
class Decision:
    """What the request becomes on this backend."""

    tools: list[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    constraint: Constraint | None
    reasoning: bool
    reasoning_budget: int | None

    def apply(self, request: NormalizedRequest) -> None:
        """Write the decision into ``request``."""
        request.tools = self.tools
        request.tool_choice = self.tool_choice
        request.parallel_tool_calls = self.parallel_tool_calls
        request.constraint = self.constraint
        request.reasoning = self.reasoning
        request.reasoning_budget = self.reasoning_budget


def is_forced(choice: ToolChoice) -> bool:
    """True when the reply must be a call (any tool, or a named one)."""
    return choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)


def declared_tool(name: str, tools: Sequence[Tool], field: str) -> Tool:
    """The declared tool called ``name``; a 400 naming ``field`` when there is none."""
    for tool in tools:
        if tool.name == name:
            return tool
    raise InvalidRequest(
        f"'{field}' names {name!r}, which is not among the declared tools", param=field
    )


def effort_switch(effort: str | None, field: str) -> bool | None:
    """An OpenAI reasoning effort as a switch: None when absent, off for none/minimal."""
    if effort is None:
        return None
    if effort in EFFORT_OFF:
        return False
    if effort in EFFORT_ON:
        return True
    raise InvalidRequest(
        f"'{field}' must be one of {', '.join(EFFORT_OFF + EFFORT_ON)}, not {effort!r}",
        param=field,
    )


def pick_constraint(
    found: Sequence[tuple[str, Constraint]], caps: Capabilities
) -> tuple[str, Constraint] | None:
    """The request's one output constraint and the field that gave it.

    ``found`` pairs each constraint the request spells with its field, in the dialect's
    order; a second one is a 400 naming it, any one on a backend without constrained
    decoding a 501 naming it.
    """
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        second = found[1][0]
        raise InvalidRequest(
            f"'{second}': at most one output constraint per request ({names} given)",
            param=second,
        )
    field, constraint = found[0]
    if caps.refuses_tools is not None:
        raise InvalidRequest(f"'{field}': {caps.refuses_tools}", param=field)
    if not caps.grammar:
        raise Unsupported(
            f"'{field}' needs constrained decoding, which this model's backend lacks",
            param=field,
            code=UNSUPPORTED,
        )
    return field, replace(constraint, field=field)


def check_stop_strings(stop: Sequence[str], field: str, caps: Capabilities) -> None:
    """A 501 naming ``field`` when the request has stop strings the backend cannot honor."""
    if stop and not caps.stop_strings:
        raise Unsupported(
            f"'{field}' needs stop strings, which this model's backend lacks",
            param=field,
            code=UNSUPPORTED,
        )


def check_system_role(field: str, caps: Capabilities) -> None:
    """A 400 naming ``field`` (where system text was given) when the model has no system role."""
    if not caps.system_role:
        raise InvalidRequest(f"'{field}': this model has no system role", param=field)


def _tools(ask: ToolAsk, caps: Capabilities) -> tuple[list[Tool], ToolChoice]:
    field, choice = ask.field, ask.choice
    if ask.tools and choice.mode is not ToolChoiceMode.NONE and caps.refuses_tools is not None:
        raise InvalidRequest(f"'tools': {caps.refuses_tools}", param="tools")
    if is_forced(choice):
        if not ask.tools:
            raise InvalidRequest(
                f"'{field}' forces a tool call, but no tools are declared", param=field
            )
        if not caps.grammar:
            raise Unsupported(
                f"'{field}' forces a tool call, which needs constrained decoding; "
                "this model's backend lacks it",
                param=field,
                code=UNSUPPORTED,
            )
        return ask.tools, choice
    if choice.mode is ToolChoiceMode.NONE:
        return [], choice  # as on OpenAI's API: the model does not see the tools
    if ask.tools and caps.tools is None:
        # Without a convention nothing in a free reply can be read as a call: the model
        # answers as plain chat, which keeps tool-sending agents usable.
        log.warning(
            "tools_dropped",
            reason="backend has no tool convention",
            tools=[tool.name for tool in ask.tools],
        )
        return [], ToolChoice()
    return ask.tools, choice


def decide(
    caps: Capabilities,
    *,
    tools: ToolAsk | None = None,
    constraints: Sequence[tuple[str, Constraint]] = (),
    reasoning: ReasoningAsk | None = None,
) -> Decision:
    """The capability decisions for one request; raises ``InvalidRequest``/``Unsupported``
    naming the dialect's field. Checks run in a fixed order — constraint, tools, reasoning —
    so a request with several problems gets the same first error in every dialect."""
    constraint = pick_constraint(constraints, caps)
    ask = tools if tools is not None else ToolAsk([], ToolChoice())
    kept, choice = _tools(ask, caps)
    switch = reasoning if reasoning is not None else ReasoningAsk()
    if switch.on and not caps.reasoning and switch.strict:
        raise InvalidRequest(
            f"'{switch.field}' switches reasoning on, but this model has no reasoning mode",
            param=switch.field,
        )
    # A grammar governs the reply from its first token: no room for a reasoning head.
    on = switch.on and caps.reasoning and constraint is None and not is_forced(choice)
    return Decision(
        tools=kept,
        tool_choice=choice,
        parallel_tool_calls=ask.parallel,
        constraint=constraint[1] if constraint is not None else None,
        reasoning=on,
        reasoning_budget=switch.budget if on else None,
    )
