"""Preparing a request: its prompt rendered and tokenized, where later prompts may share it,
and the grammar and tool convention its reply follows.

``validate`` prepares a request and :class:`Preparation` keeps the result (a
:class:`Prepared`) for ``begin`` to take, so the work is done once. The prompt is the
request's token ids as given (``prompt_ids``), a raw completion prompt, or the conversation
rendered by the file's chat template: control-token text that messages and tools supply is
tokenized as text, never as control tokens. A forced tool call (``tool_choice`` required or
named) is a grammar over the convention's call syntax — or, for a family without one, over
a bare ``{"name", "arguments"}`` object — so it works on every family. An output constraint
governs the reply's text: a forced call does not heed it, and with calls allowed the grammar
is calls or the constraint's text (:mod:`lmserve_core.chat_grammar` compiles them).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from .backend import Capabilities
from .chat_grammar import Grammars, either_grammar, field_of, forces_call, grammar_field
from .chat_template import ChatTemplate, ControlTextGuard, message_dicts, tool_dicts
from .errors import InvalidRequest, LmserveError, Unsupported
from .kv_slots import common_prefix_length
from .model import FamilyConventions
from .request import Constraint, Message, NormalizedRequest, ToolChoiceMode
from .tokenizer import Tokenizer, TooManyTokens
from .tools import JSON_CALL, ToolConvention, forced_call_grammar

log = structlog.get_logger("lmserve.gguf_chat")

_PREPARED_MAX = 64  # renderings kept between validate and generate
# Earlier messages whose end a checkpointed cache keeps (``Preparation.shared_prefixes``):
# each costs a rendering of the conversation up to it.
SHARED_MESSAGES = 2
_PROBE = "\ue0ff"  # a message text no message begins with, to find where one begins


@dataclass(slots=True)
class Prepared:
    """What validate worked out for one request, handed on to generate."""

    request: NormalizedRequest
    tokens: list[int]
    max_tokens: int
    think_inside: bool  # the prompt itself opened a think block
    matcher: Any = None  # llguidance.LLMatcher, fresh
    tools: ToolConvention | None = None  # how calls in the reply are read (None: they are not)
    grammar_field: str | None = None  # the request field the matcher's grammar came from
    # where later prompts may leave this one (``Preparation.shared_prefixes``)
    shared: tuple[int, ...] = ()


class Preparation:
    """Prepares requests for one model: its tokenizer and chat template, the family's
    conventions and what the backend can do. ``template`` and ``capabilities`` may be
    replaced (the backend's attributes of those names are these)."""

    def __init__(
        self,
        *,
        name: str,
        model_id: str,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        conventions: FamilyConventions,
        capabilities: Capabilities,
        grammars: Grammars,
        context_length: int,
        vocab_size: int,
        checkpointed: bool,
    ) -> None:
        self.name = name
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.template = template
        self.conventions = conventions
        self.capabilities = capabilities
        self.grammars = grammars
        self.context_length = context_length
        self.vocab_size = vocab_size  # the ids the model's logits cover
        # a cache that cannot be cut back keeps checkpoints where prompts may share a prefix
        self.checkpointed = checkpointed
        self.pending: OrderedDict[str, Prepared] = OrderedDict()  # validated, not yet begun
        self._lock = threading.Lock()

    def remember(self, prepared: Prepared) -> None:
        """Keep ``prepared`` for :meth:`take` (the latest ``_PREPARED_MAX`` of them)."""
        request = prepared.request
        with self._lock:
            self.pending[request.id] = prepared
            self.pending.move_to_end(request.id)
            while len(self.pending) > _PREPARED_MAX:
                self.pending.popitem(last=False)

    def take(self, request: NormalizedRequest) -> Prepared:
        """What validate worked out for ``request``, or that worked out now."""
        with self._lock:
            prepared = self.pending.pop(request.id, None)
        if prepared is None or prepared.request is not request:
            prepared = self.prepare(request)
        return prepared

    def count_tokens(self, request: NormalizedRequest) -> int:
        """Prompt tokens of ``request`` exactly as ``generate`` would feed them."""
        return len(self.prompt_tokens(request)[0])

    def prompt_tokens(
        self, request: NormalizedRequest, most: int | None = None
    ) -> tuple[list[int], str | None]:
        """The prompt's token ids, and the rendered chat text (None for raw prompts). With
        ``most``, ``TooManyTokens`` once there are more than ``most`` of them: the work is
        then bounded by ``most``, not by the prompt's length."""
        if request.prompt_ids is not None:
            # Token ids are the model's input as given: no BOS, no special-token parsing.
            self.check_ids(request.prompt_ids, "prompt")
            if most is not None and len(request.prompt_ids) > most:
                raise TooManyTokens(len(request.prompt_ids), most, exact=True)
            return list(request.prompt_ids), None
        if request.prompt is not None:
            # Raw completions: BOS per the vocabulary, special-token text parsed like
            # llama-server does.
            return self._encode_prompt(request.prompt, most, ()), None
        # A BOS the template writes itself was dropped from the text when the vocabulary
        # adds one (ChatTemplate.from_gguf), as llama.cpp does.
        text, plain = self.render(request, most)
        return self._encode_prompt(text, most, plain), text

    def _encode_prompt(
        self, text: str, most: int | None, plain: Sequence[tuple[int, int]]
    ) -> list[int]:
        if most is None:
            return self.tokenizer.encode(text, add_special=True, parse_special=True, plain=plain)
        return self.tokenizer.encode_within(
            text, most, add_special=True, parse_special=True, plain=plain
        )

    def prepare(self, request: NormalizedRequest) -> Prepared:
        param = "prompt" if request.prompt is not None else "messages"
        try:
            # a prompt that cannot fit is found out within the context's worth of tokens
            tokens, text = self.prompt_tokens(request, most=self.context_length - 1)
        except TooManyTokens as exc:
            size = str(exc.at_least) if exc.exact else f"at least {exc.at_least}"
            raise InvalidRequest(
                f"prompt is {size} tokens; the context is {self.context_length}",
                param=param,
                code="context_length_exceeded",
            ) from None
        markers = self.conventions.think
        think_inside = (
            text is not None
            and markers is not None
            and self.thinking(request)
            and text.rstrip().endswith(markers.open)
        )
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("the prompt is empty", param=param)
        if n >= self.context_length:
            raise InvalidRequest(
                f"prompt is {n} tokens; the context is {self.context_length}",
                param=param,
                code="context_length_exceeded",
            )
        max_tokens = max(0, min(int(request.max_tokens), self.context_length - n))
        self._check_bias(request)
        matcher, tools = self.tool_plan(request)
        field = grammar_field(request) if matcher is not None else None
        shared = self.shared_prefixes(request, tokens) if self.checkpointed else ()
        return Prepared(request, tokens, max_tokens, think_inside, matcher, tools, field, shared)

    def shared_prefixes(self, request: NormalizedRequest, tokens: list[int]) -> tuple[int, ...]:
        """Prompt positions where later prompts may leave this one: the end of its leading
        system messages (other conversations with the same system prompt) and of its last
        ``SHARED_MESSAGES`` earlier messages (a turn edited, retried, or answered otherwise),
        with the next message's opener. Each is found by rendering the conversation with
        that message's text replaced (templates may refuse a conversation stopped early):
        the tokens that rendering shares with the prompt."""
        messages = request.messages
        if request.prompt is not None or len(messages) < 2:
            return ()
        n = len(messages)
        lead = next((i for i, m in enumerate(messages) if m.role != "system"), n)
        cuts = sorted({lead, *range(n - SHARED_MESSAGES, n)} & set(range(1, n)))
        out: list[int] = []
        for k in cuts:
            probe = Message(role=messages[k].role, content=_PROBE)
            other = replace(request, messages=[*messages[:k], probe])
            try:
                text, plain = self.render(other, opener=False)
                ids = self._encode_prompt(text, len(tokens), plain)
            except (LmserveError, TooManyTokens):  # a template that wants the whole chat
                continue
            out.append(common_prefix_length(ids, tokens))
        return tuple(p for p in out if p > 0)

    def _check_bias(self, request: NormalizedRequest) -> None:
        """A 400 naming ``logit_bias`` for a biased id outside the vocabulary."""
        n = self.vocab_size
        for token in request.sampling.logit_bias or ():
            if not 0 <= token < n:
                raise InvalidRequest(
                    f"'logit_bias' key '{token}' is not a token id of this model "
                    f"(its vocabulary is 0 to {n - 1})",
                    param="logit_bias",
                )

    def tool_plan(self, request: NormalizedRequest) -> tuple[Any, ToolConvention | None]:
        """The grammar decoding follows (a fresh matcher, or None) and the convention that
        reads calls in the reply.

        - A forced call: the call grammar. An output constraint governs text, and a forced
          reply has none: it does not take part.
        - Calls allowed (auto) and an output constraint: a reply is either calls — the call
          grammar, arguments held to their schemas leniently, as ``auto`` promises no more —
          or text of the constraint. Tools whose grammar cannot be written or compiled
          leave the constraint alone (logged ``tools_unconstrained``): the model answers.
        - Otherwise the output constraint, if any.
        """
        convention = self.capabilities.tools
        choice = request.tool_choice
        constraint = request.constraint
        forced = forces_call(request)
        if (forced or constraint is not None) and not self.capabilities.grammar:
            raise Unsupported(
                f"backend {self.name!r} does not do constrained decoding",
                param=grammar_field(request),
            )
        if not forced:
            calls = convention if request.tools and choice.mode != ToolChoiceMode.NONE else None
            if constraint is None:
                return None, calls
            grammar = self.grammars.compile(constraint)
            if calls is not None:
                either = self._calls_or(request, calls, grammar)
                if either is not None:
                    return either, calls
            return self.grammars.matcher(grammar, constraint.kind, field_of(constraint)), calls
        # Without a convention of its own, the model writes the call as a bare object.
        convention = convention or JSON_CALL
        only = choice.name if choice.mode == ToolChoiceMode.NAMED else None
        try:
            grammar = forced_call_grammar(
                convention, request.tools, only=only, parallel=request.parallel_tool_calls
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="tool_choice") from None
        call = Constraint("lark", grammar, field="tool_choice")
        return self.grammars.matcher(self.grammars.compile(call), "lark", "tool_choice"), convention

    def _calls_or(self, request: NormalizedRequest, convention: ToolConvention, reply: str) -> Any:
        """A matcher for calls of the request's tools or the ``reply`` grammar's text; None
        (logged) when the tools' grammar cannot be had."""
        try:
            calls = self.grammars.compile(
                Constraint(
                    "lark",
                    forced_call_grammar(
                        convention,
                        request.tools,
                        parallel=request.parallel_tool_calls,
                        lenient=True,
                    ),
                )
            )
            both = either_grammar(calls, reply)
            return self.grammars.matcher(both, "lark", grammar_field(request))
        except (ValueError, InvalidRequest) as exc:
            log.warning(
                "tools_unconstrained",
                reason=str(exc),
                tools=[tool.name for tool in request.tools],
                model=self.model_id,
            )
            return None

    def render(
        self, request: NormalizedRequest, most: int | None = None, opener: bool = True
    ) -> tuple[str, list[tuple[int, int]]]:
        """The chat prompt, and the spans of control-token text its messages and tools
        supplied: those are tokenized as text, never as control tokens. With ``most``, a
        prompt too long for that many tokens by its length alone is ``TooManyTokens`` before
        those spans are found (one each: there may be millions). Without ``opener``, the
        conversation alone, without the reply's opener."""
        guard = ControlTextGuard(self.tokenizer.control_texts_in)
        kwargs: dict[str, Any] = dict(request.template_kwargs)
        switch = self.conventions.thinking_switch
        if switch is not None:
            # the decision the dialects and the grammar made; a template variable of the
            # same name must not undo it
            kwargs[switch] = self.thinking(request)
        hidden = request.tool_choice.mode == ToolChoiceMode.NONE
        tools = None if hidden else (guard.apply(tool_dicts(request.tools)) or None)
        messages = guard.apply(message_dicts(request.messages))
        text = self.template.render(messages, tools=tools, add_generation_prompt=opener, **kwargs)
        if opener and tools and self.capabilities.tools is None and forces_call(request):
            # A family without a convention gets its forced call from a grammar; if its
            # template ignores the declarations, they go into a system message instead, so
            # the model knows what it is calling.
            bare = self.template.render(messages, tools=None, add_generation_prompt=True, **kwargs)
            if bare == text:
                messages = _with_declarations(messages, tools)
                text = self.template.render(
                    messages, tools=None, add_generation_prompt=True, **kwargs
                )
        finish = self.conventions.finish_prompt if opener else None
        text = text if finish is None else finish(text)
        if most is not None:
            at_least = self.tokenizer.fewest_tokens(guard.restored_length(text))
            if at_least > most:
                raise TooManyTokens(at_least, most)
        return guard.restore(text)

    @staticmethod
    def thinking(request: NormalizedRequest) -> bool:
        # A grammar (an output constraint or a forced call) governs the reply from its first
        # token: no reasoning head then.
        return (
            bool(request.reasoning)
            and request.constraint is None
            and not forces_call(request)
            and request.prompt is None
        )

    def check_ids(self, ids: Sequence[int], param: str | None = None) -> None:
        # a prompt's ids index the model's embeddings too
        n = self.tokenizer.vocab_size if param is None else self.vocab_size
        for tid in ids:
            if not 0 <= int(tid) < n:
                raise InvalidRequest(
                    f"token id {tid} is outside the vocabulary [0, {n})", param=param
                )


def _with_declarations(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the tool declarations and the call format in a system message
    (joined to the first one when there is one)."""
    lines = [
        "You have these functions. Call one by replying with only a JSON object "
        '{"name": <function-name>, "arguments": <arguments-object>}.'
    ]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    note = "\n".join(lines)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{note}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
