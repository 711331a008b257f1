"""The normalized request: what every dialect translates into, and what backends read."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(slots=True)
class ToolCall:
    """A function call the model made (or made in an earlier turn of the history)."""

    id: str
    name: str
    arguments: str  # JSON text, exactly as the model produced it
    # The token bound cut the call off: ``arguments`` is the text written so far, which may
    # be incomplete JSON (a reply's last call only).
    partial: bool = False


@dataclass(slots=True)
class Message:
    """One turn of the conversation, reduced to text.

    ``content`` is the plain text of the turn; ``reasoning`` holds replayed reasoning
    (most templates drop it); ``tool_calls`` are the calls an assistant turn made and
    ``tool_call_id``/``name`` identify the call a ``tool`` turn answers.
    """

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Tool:
    """A function declaration offered to the model."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    strict: bool = False


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"  # any tool
    NAMED = "named"  # the tool named in ToolChoice.name


@dataclass(slots=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None


@dataclass(slots=True)
class Constraint:
    """Constrained-decoding request: the grammar the reply must match."""

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    source: str  # JSON schema text, regex or lark grammar; "" for json_object
    name: str | None = None
    strict: bool = True
    field: str | None = None  # the request field that gave it (errors name it)


@dataclass(frozen=True, slots=True)
class DiffusionSampling:
    """A request's overrides of a block-diffusion model's sampler (the ``diffusion`` object
    of every dialect); ``None`` fields keep the model's own (its GGUF's ``diffusion.eb_*``).
    Token-by-token models ignore them."""

    max_steps: int | None = None  # denoising steps per block, at most
    t_min: float | None = None  # temperature of the last step
    t_max: float | None = None  # temperature of the first step
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None


@dataclass(slots=True)
class Sampling:
    """Sampling fields; ``None`` means "the model's recommended default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    # Added to the logits of these token ids before anything else (OpenAI's logit_bias);
    # None or empty: no bias.
    logit_bias: dict[int, float] | None = None
    diffusion: DiffusionSampling | None = None


DEFAULT_MAX_TOKENS = 1024


@dataclass(slots=True)
class NormalizedRequest:
    """One generation request, independent of the wire dialect it arrived in.

    Exactly one of ``messages`` (chat) or ``prompt`` (raw text completion) is used:
    ``prompt`` is not None for ``/v1/completions``. A token-id prompt comes as
    ``prompt_ids`` (read verbatim: no BOS added) with ``prompt`` the empty string.
    """

    id: str
    dialect: Literal["chat", "responses", "messages", "completions"]
    messages: list[Message] = field(default_factory=list)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int = DEFAULT_MAX_TOKENS
    # Log-probabilities of the sampled tokens with this many alternatives each (0: the
    # sampled token's alone); None: none.
    logprobs: int | None = None
    n: int = 1  # choices: the dialect submits this many copies (choices_of)
    stop: list[str] = field(default_factory=list)
    constraint: Constraint | None = None
    reasoning: bool = False
    # Most reasoning tokens before the think block is closed and the answer follows
    # (Anthropic's thinking.budget_tokens); None: no cap beyond max_tokens.
    reasoning_budget: int | None = None
    parallel_tool_calls: bool = True  # a forced call may be several calls in one reply
    stream: bool = False
    include_usage: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    # Set by the backend's validate: the prompt's token count, known before generation
    # (Anthropic's message_start reports it).
    prompt_tokens: int | None = None


def choices_of(request: NormalizedRequest) -> list[NormalizedRequest]:
    """The ``n`` generations of a request: copies with their own ids (``<id>-<i>``) and,
    when the request has a seed, seeds ``seed + i``, so sampled choices differ."""
    if request.n <= 1:
        return [request]
    out = []
    for i in range(request.n):
        seed = request.sampling.seed
        sampling = dataclasses.replace(
            request.sampling, seed=None if seed is None else seed + i
        )
        out.append(dataclasses.replace(request, id=f"{request.id}-{i}", n=1, sampling=sampling))
    return out
