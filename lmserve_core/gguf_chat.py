"""The generic GGUF chat path: a Backend built from a family's forward pass.

Tokenizer and chat template come from the GGUF metadata; the family supplies the forward
pass and its conventions. Per request: render and tokenize the prompt, adopt a KV slot
(reusing the longest shared token prefix), prefill the rest in chunks, then decode one
token at a time — sample, stop on end-of-generation tokens, stop strings, a finished
grammar or the token budget — streaming whole-code-point text as it goes.

Decoded text passes an ordered chain of filters (:class:`_Output`): stop strings, then the
reasoning router (think markers), then the tool-call parser of the family's convention,
then events. Each holds back only what may still become a marker. A forced tool call
(``tool_choice`` required or named) is a grammar over the convention's call syntax — or,
for a family without one, over a bare ``{"name", "arguments"}`` object — so it works on
every family. An output constraint governs the reply's text: a forced call does not heed
it, and with calls allowed the grammar is calls or the constraint's text. A JSON schema's
objects are closed (``tools.closed_schema``). A reply the token bound cuts off inside a call
gives the call, partial, never its notation as text.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import structlog

from . import memory
from .backend import AUTO_SLOTS, Capabilities, ServerSettings
from .cartridge.route import FleetRouter
from .cartridge.serve import PrefixRows, prefixed_model
from .chat_template import ChatTemplate, ControlTextGuard, message_dicts, tool_dicts
from .errors import InvalidRequest, LmserveError, Unsupported
from .events import (
    ErrorEvent,
    EventSink,
    Finish,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    TokenAlternative,
    TokenLogprob,
    ToolCallEvent,
    Usage,
)
from .gguf_file import GGUFFile
from .kv_disk import DiskTier, model_fingerprint
from .kv_slots import KVSlot, SlotPool, common_prefix_length
from .model import CacheKind, FamilyConventions, ForwardModel, KVCache
from .reasoning import ThinkRouter
from .request import Constraint, Message, NormalizedRequest, ToolCall, ToolChoiceMode
from .sampling import Sampler, resolve
from .speculative import (
    FORCED,
    MAX_DRAFT,
    Acceptance,
    Drafter,
    DraftModel,
    DraftSource,
    Pace,
    PromptLookup,
    VerifyCost,
)
from .stops import StopScanner
from .tokenizer import StreamDecoder, Tokenizer, TooManyTokens
from .tools import JSON_CALL, ToolCallParser, ToolConvention, closed_schema, forced_call_grammar

log = structlog.get_logger("lmserve.gguf_chat")

_T = TypeVar("_T")

PREFILL_CHUNK = 512  # most prompt tokens read in one step
# While other generations decode, a step reads about this many seconds of prompt, and at
# least PREFILL_MIN_SLICE tokens: a long prompt arriving mid-stream delays the others' next
# token by about this much, not by its whole prefill. The slice follows the time the last
# chunk took (a chunk's cost grows with its position).
PREFILL_SLICE_S = 0.2
PREFILL_MIN_SLICE = 32
_PREPARED_MAX = 64  # renderings kept between validate and generate
# Earlier messages whose end a checkpointed cache keeps (``_shared_prefixes``): each costs a
# rendering of the conversation up to it.
SHARED_MESSAGES = 2
_PROBE = "\ue0ff"  # a message text no message begins with, to find where one begins

# JSON output in one fixed, readable layout: free whitespace lets small models pad forever.
_JSON_OPTIONS: Any = {  # llguidance's JsonCompileOptions
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(slots=True)
class _Prepared:
    """What validate worked out for one request, handed on to generate."""

    request: NormalizedRequest
    tokens: list[int]
    max_tokens: int
    think_inside: bool  # the prompt itself opened a think block
    matcher: Any = None  # llguidance.LLMatcher, fresh
    tools: ToolConvention | None = None  # how calls in the reply are read (None: they are not)
    grammar_field: str | None = None  # the request field the matcher's grammar came from
    # where later prompts may leave this one (``GGUFChatBackend._shared_prefixes``)
    shared: tuple[int, ...] = ()


@dataclass(eq=False, slots=True)
class Generation:
    """One request being generated: its prompt, slot, sampler, filters and progress.

    ``logits`` are those of the last row written, while a token is to be sampled from them;
    ``todo`` holds tokens sampled whose rows are still to be written (a correction after a
    rejected draft, or the tokens that close a think block). ``finish`` is set when it has
    ended.
    """

    request: NormalizedRequest
    prepared: _Prepared
    sink: EventSink
    usage: Usage
    slot: KVSlot[KVCache] | None = None
    sampler: Sampler = field(init=False)
    decoder: StreamDecoder = field(init=False)
    out: _Output | None = None
    bits: Any = None  # the grammar's token mask words
    budget_close: tuple[int, list[int]] | None = None
    generated: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None
    prefilled: bool = False  # its whole prompt has been read
    todo: list[int] = field(default_factory=list)  # sampled, their rows not yet written
    drafter: Drafter | None = None
    pace: Pace | None = None
    finish: Finish | None = None

    @property
    def kv(self) -> KVSlot[KVCache]:
        """The slot of a generation that has started."""
        assert self.slot is not None
        return self.slot


class GGUFChatBackend:
    """A :class:`~lmserve_core.backend.Backend` over a GGUF file and a ``ForwardModel``."""

    def __init__(
        self,
        *,
        name: str,
        gguf: GGUFFile,
        model: ForwardModel,
        conventions: FamilyConventions,
        settings: ServerSettings,
        model_id: str | None = None,
        family: str | None = None,
    ) -> None:
        self.name = name
        self.family = family or name  # the family plugin's name, e.g. "qwen3" for qwen3moe
        self.gguf = gguf
        self.model = model
        self.conventions = conventions
        self.settings = settings
        self.model_id = model_id or gguf.model_id or Path(gguf.path).stem
        # --cartridge: a KV prefix every cache starts with (lmserve_core.cartridge.serve)
        self.prefix: PrefixRows | None = None
        cartridge = settings.prefixes.cartridge
        if cartridge:
            wrapped = prefixed_model(model, cartridge, gguf, self.model_id)
            self.prefix = wrapped.prefix
            self.model = model = wrapped
        conventions = file_sampling(gguf, conventions)
        self.conventions = conventions
        # the sampler biases logits by token id, and prompts may be token ids, on every family
        self.capabilities: Capabilities = replace(
            conventions.capabilities, logit_bias=True, token_prompts=True
        )
        self.context_length = int(settings.ctx)
        if self.context_length < 2:
            raise ValueError(f"the context must hold at least 2 tokens, got {self.context_length}")
        n_ctx_train = int(getattr(model, "n_ctx_train", 0) or 0)
        if n_ctx_train and self.context_length > n_ctx_train:
            log.warning(
                "context_exceeds_training",
                ctx=self.context_length,
                n_ctx_train=n_ctx_train,
                model=self.model_id,
            )

        self.tokenizer = Tokenizer.from_gguf(gguf)
        self.tokenizer.longest_token  # noqa: B018 - the length bound of prompts, found now
        # --fleet: each conversation behind the cartridges of its documents
        self.fleet: FleetRouter | None = None
        fleet = settings.prefixes.fleet
        if fleet is not None:
            if cartridge or settings.disk.directory:
                raise ValueError("a fleet is served without --cartridge and --kv-cache-dir")
            rag = settings.prefixes.retrieval
            self.fleet = FleetRouter(fleet, model, self.tokenizer, what=self.model_id,
                                     docs=rag.docs, chunks=rag.chunks,
                                     adaptive=rag.adaptive, margin=rag.margin)
            self.model = model = self.fleet.wrap(model)
            log.info("fleet", path=str(fleet.path), documents=len(fleet.docs), p=fleet.p,
                     rag_docs=self.fleet.k, prefix_rows=self.fleet.rows,
                     adaptive=self.fleet.adaptive, model=self.model_id)
        self.template = ChatTemplate.from_gguf(
            gguf, self.tokenizer, fallback=conventions.fallback_template
        )
        # Logit rows past the tokenizer's vocabulary are padding: never sample them.
        self.vocab_size = min(int(model.n_vocab), self.tokenizer.vocab_size)
        stop_ids = set(self.tokenizer.eog_ids)
        for text in conventions.extra_stop_tokens:
            tid = self.tokenizer.token_id(text)
            if tid is None:
                log.warning("unknown_stop_token", token=text, model=self.model_id)
            else:
                stop_ids.add(tid)
        self.stop_ids: frozenset[int] = frozenset(stop_ids)
        # control tokens the reply's text keeps (the family's readers see them)
        shown = (self.tokenizer.token_id(text) for text in conventions.shown_tokens)
        self.shown_ids: frozenset[int] = frozenset(t for t in shown if t is not None)

        # Generations decoded together; each holds a slot while it runs.
        self.batch_size = max(1, int(settings.batch))
        per_pos = getattr(model, "kv_bytes_per_pos", None)
        whole = getattr(model, "kv_bytes", None)
        # what the slots take once every position is written (pages commit lazily)
        full = whole(self.context_length) if callable(whole) else (
            None if per_pos is None else per_pos * self.context_length
        )
        if settings.kv_slots == AUTO_SLOTS:
            avail = settings.available_memory or memory.available()
            n_slots = memory.auto_kv_slots(full, avail, self.batch_size)
        else:
            n_slots = max(1, int(settings.kv_slots), self.batch_size)
        n_slots = self._guard_memory(settings, per_pos, full, n_slots)
        # the KV memory the slots take at full context (the start-up banner says it)
        self.kv_slots = n_slots
        self.kv_bytes: int | None = None if full is None else int(full) * n_slots
        log.info(
            "kv_cache",
            model=self.model_id,
            kv_type=getattr(model, "kv_type", None),
            bytes_per_position=per_pos,
            ctx=self.context_length,
            slots=n_slots,
            full_mib=None if full is None else round(full * n_slots / 2**20, 1),
        )
        # what the family's caches can do (a small one asked)
        probe = self.model.new_cache(16)
        self.cache_kind: CacheKind = probe.kind
        _close(probe)
        self.slots: SlotPool[KVCache] = SlotPool(
            n_slots,
            lambda: self.model.new_cache(self.context_length),
            self.model.copy_rows,
            disk=self._disk_tier(gguf, settings),
        )
        # a cache that cannot be cut back keeps checkpoints where prompts may share a prefix
        self._checkpointed = not self.cache_kind.truncate
        self._prepared: OrderedDict[str, _Prepared] = OrderedDict()
        self._prepared_lock = threading.Lock()
        self._grammar_tokenizer: Any = None
        self._grammar_lock = threading.Lock()
        self._prefill_slice = 2 * PREFILL_MIN_SLICE  # prompt tokens read per shared step
        self.drafts = self._draft_source(settings)
        # what verify rows cost (calibrated here, checked by the passes of generations that
        # speculate) and how each kind of draft fares, for every generation's Pace
        self.verify_cost = VerifyCost()
        self.acceptance = Acceptance()
        if self.drafts is not None:
            self._calibrate()

    def _disk_tier(self, gguf: GGUFFile, settings: ServerSettings) -> DiskTier | None:
        """The KV disk tier under ``kv_cache_dir``, for this model and cache layout."""
        directory = settings.disk.directory
        if not directory:
            return None
        kind = self.cache_kind
        identity = {
            "model": model_fingerprint(gguf),
            "cache_kind": kind.name,
            "geometry": [list(layer) for layer in getattr(self.model, "cache_layers", None) or []],
            "kv_type": getattr(self.model, "kv_type", None),
            # the prefix under every file's rows (none without --cartridge)
            "prefix": None if self.prefix is None else self.prefix.record(),
        }
        if not kind.snapshot:
            log.warning("kv_disk_unsupported", kind=kind.name, model=self.model_id)
            return None
        return DiskTier(
            directory, identity,
            max_files=settings.disk.max_files,
            max_bytes=int(settings.disk.max_gb * 2**30),
        )

    def _guard_memory(
        self, settings: ServerSettings, per_pos: int | None, per_slot: int | None, n_slots: int
    ) -> int:
        """The RAM guard (``memory.plan_kv_slots``): the slots to keep, with the arithmetic
        logged. Fewer slots than ``--batch`` lower the batch too (a slot per generation)."""
        if per_slot is None:
            return n_slots
        avail = settings.available_memory or memory.available()
        plan = memory.plan_kv_slots(
            int(per_slot), n_slots, avail, force=settings.kv_slots_force
        )
        fields = dict(
            bytes_per_position=per_pos,
            bytes_per_slot=int(per_slot),
            slots=n_slots,
            total_bytes=int(per_slot) * n_slots,
            available_bytes=avail,
            model=self.model_id,
        )
        if plan.verdict in ("fits", "unknown"):
            log.info("kv_memory", **fields, verdict=plan.verdict)
        elif plan.verdict == "clamped":
            log.warning(
                "kv_memory", **fields, verdict="clamped", kept_slots=plan.slots,
                detail="the slots would not fit in memory: kept what fits in half of it "
                "(--kv-slots-force keeps them all)",
            )
        else:
            log.warning(
                "kv_memory", **fields, verdict=plan.verdict,
                detail="the slots take more than half of the available memory",
            )
        self.batch_size = min(self.batch_size, plan.slots)
        return plan.slots

    def _calibrate(self) -> None:
        """Measure what a verify row costs on this machine (``VerifyCost.calibrate``);
        without it, the generations' own passes tell."""
        started = time.perf_counter()
        try:
            row = self.verify_cost.calibrate(self.model)
        except Exception:  # a model that cannot run the calibration still speculates
            log.exception("spec_calibration_failed", model=self.model_id)
            return
        log.info(
            "spec_calibration", model=self.model_id, row_cost=round(row, 3),
            seconds=round(time.perf_counter() - started, 2),
        )

    def _draft_source(self, settings: ServerSettings) -> DraftSource | None:
        """Speculative decoding's drafts: a draft model (``spec_draft``, a GGUF path), the
        conversation itself (``spec``), or none."""
        path = settings.speculation.draft
        if not path:
            return PromptLookup() if settings.speculation.prompt_lookup else None
        from . import plugins

        draft_gguf = GGUFFile.open(path)
        spec = plugins.backend_for_architecture(draft_gguf.architecture)
        draft_gguf.close()
        if spec is None:
            raise ValueError(f"no installed family serves the draft's {draft_gguf.architecture!r}")
        draft_settings = ServerSettings(
            ctx=self.context_length, threads=settings.threads, kv_slots=1,
            kv_type=settings.kv_type, batch=1,
        )
        draft = spec.factory(str(path), draft_settings)
        model = getattr(draft, "model", None)
        tokenizer = getattr(draft, "tokenizer", None)
        n = self.tokenizer.vocab_size
        if (
            model is None
            or tokenizer is None
            or tokenizer.vocab_size != n
            or any(tokenizer.token_bytes(i) != self.tokenizer.token_bytes(i) for i in range(n))
        ):
            draft.close()
            raise ValueError(f"the draft model {path} does not share this model's vocabulary")
        log.info("draft_model", path=str(path), backend=spec.name, model=self.model_id)
        return DraftModel(model, self.context_length, owner=draft)

    # ------------------------------------------------------------------ Backend protocol

    def validate(self, request: NormalizedRequest) -> None:
        """Render and tokenize the prompt, check it fits, compile any grammar."""
        prepared = self._prepare(request)
        request.prompt_tokens = len(prepared.tokens)
        with self._prepared_lock:
            self._prepared[request.id] = prepared
            self._prepared.move_to_end(request.id)
            while len(self._prepared) > _PREPARED_MAX:
                self._prepared.popitem(last=False)

    def generate(self, request: NormalizedRequest, sink: EventSink) -> Finish:
        """Generate the reply alone, streaming events into ``sink``; never raises."""
        try:
            gen = self.begin(request, sink)
        except LmserveError as exc:
            sink.emit(ErrorEvent(exc.message, exc.status, exc.kind))
            return Finish("error", Usage())
        except Exception as exc:  # one bad request must not take the worker down
            log.exception("generate_failed", id=request.id, model=self.model_id)
            sink.emit(ErrorEvent(f"generation failed: {exc}", 500, "server_error"))
            return Finish("error", Usage())
        while gen.finish is None:
            self.step([gen])
        return gen.finish

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text``."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        self._check_ids(ids)
        return self.tokenizer.decode(ids)

    def token_piece(self, token_id: int) -> bytes:
        """The raw bytes of one token."""
        self._check_ids([token_id])
        return self.tokenizer.token_bytes(token_id)

    def close(self) -> None:
        """Keep the resident slots in the disk tier (when there is one), then free the
        caches and the model."""
        if self.slots.disk is not None:
            try:
                written = self.slots.flush()
                log.info("kv_disk_flushed", files=written, model=self.model_id)
            except Exception:  # the stop goes on: what is on disk stays valid
                log.exception("kv_disk_flush_failed", model=self.model_id)
        for slot in self.slots.slots:
            if slot.allocated:
                _close(slot.cache)
        self.slots.clear()
        _close(self.drafts)
        _close(self.model)
        _close(self.gguf)

    # ------------------------------------------------------------------ prompt

    def count_tokens(self, request: NormalizedRequest) -> int:
        """Prompt tokens of ``request`` exactly as ``generate`` would feed them."""
        return len(self._prompt_tokens(request)[0])

    def _prompt_tokens(
        self, request: NormalizedRequest, most: int | None = None
    ) -> tuple[list[int], str | None]:
        """The prompt's token ids, and the rendered chat text (None for raw prompts). With
        ``most``, ``TooManyTokens`` once there are more than ``most`` of them: the work is
        then bounded by ``most``, not by the prompt's length."""
        if request.prompt_ids is not None:
            # Token ids are the model's input as given: no BOS, no special-token parsing.
            self._check_ids(request.prompt_ids, "prompt")
            if most is not None and len(request.prompt_ids) > most:
                raise TooManyTokens(len(request.prompt_ids), most, exact=True)
            return list(request.prompt_ids), None
        if request.prompt is not None:
            # Raw completions: BOS per the vocabulary, special-token text parsed like
            # llama-server does.
            return self._encode_prompt(request.prompt, most, ()), None
        # A BOS the template writes itself was dropped from the text when the vocabulary
        # adds one (ChatTemplate.from_gguf), as llama.cpp does.
        text, plain = self._render(request, most)
        return self._encode_prompt(text, most, plain), text

    def _encode_prompt(
        self, text: str, most: int | None, plain: Sequence[tuple[int, int]]
    ) -> list[int]:
        if most is None:
            return self.tokenizer.encode(text, add_special=True, parse_special=True, plain=plain)
        return self.tokenizer.encode_within(
            text, most, add_special=True, parse_special=True, plain=plain
        )

    def _prepare(self, request: NormalizedRequest) -> _Prepared:
        param = "prompt" if request.prompt is not None else "messages"
        try:
            # a prompt that cannot fit is found out within the context's worth of tokens
            tokens, text = self._prompt_tokens(request, most=self.context_length - 1)
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
            and self._thinking(request)
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
        matcher, tools = self._tool_plan(request)
        field = _grammar_field(request) if matcher is not None else None
        shared = self._shared_prefixes(request, tokens) if self._checkpointed else ()
        return _Prepared(request, tokens, max_tokens, think_inside, matcher, tools, field, shared)

    def _shared_prefixes(self, request: NormalizedRequest, tokens: list[int]) -> tuple[int, ...]:
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
                text, plain = self._render(other, opener=False)
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

    def _tool_plan(self, request: NormalizedRequest) -> tuple[Any, ToolConvention | None]:
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
        forced = _forced(request)
        if (forced or constraint is not None) and not self.capabilities.grammar:
            raise Unsupported(
                f"backend {self.name!r} does not do constrained decoding",
                param=_grammar_field(request),
            )
        if not forced:
            calls = convention if request.tools and choice.mode != ToolChoiceMode.NONE else None
            if constraint is None:
                return None, calls
            grammar = self._grammar(constraint)
            if calls is not None:
                either = self._calls_or(request, calls, grammar)
                if either is not None:
                    return either, calls
            return self._matcher(grammar, constraint.kind, _field_of(constraint)), calls
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
        return self._matcher(self._grammar(call), "lark", "tool_choice"), convention

    def _calls_or(self, request: NormalizedRequest, convention: ToolConvention, reply: str) -> Any:
        """A matcher for calls of the request's tools or the ``reply`` grammar's text; None
        (logged) when the tools' grammar cannot be had."""
        try:
            calls = self._grammar(
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
            return self._matcher(_either(calls, reply), "lark", _grammar_field(request))
        except (ValueError, InvalidRequest) as exc:
            log.warning(
                "tools_unconstrained",
                reason=str(exc),
                tools=[tool.name for tool in request.tools],
                model=self.model_id,
            )
            return None

    def _render(
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
            kwargs[switch] = self._thinking(request)
        hidden = request.tool_choice.mode == ToolChoiceMode.NONE
        tools = None if hidden else (guard.apply(tool_dicts(request.tools)) or None)
        messages = guard.apply(message_dicts(request.messages))
        text = self.template.render(messages, tools=tools, add_generation_prompt=opener, **kwargs)
        if opener and tools and self.capabilities.tools is None and _forced(request):
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
    def _thinking(request: NormalizedRequest) -> bool:
        # A grammar (an output constraint or a forced call) governs the reply from its first
        # token: no reasoning head then.
        return (
            bool(request.reasoning)
            and request.constraint is None
            and not _forced(request)
            and request.prompt is None
        )

    def _take_prepared(self, request: NormalizedRequest) -> _Prepared:
        with self._prepared_lock:
            prepared = self._prepared.pop(request.id, None)
        if prepared is None or prepared.request is not request:
            prepared = self._prepare(request)
        return prepared

    # ------------------------------------------------------------------ constraints

    def _grammar(self, constraint: Constraint) -> str:
        """The llguidance grammar of ``constraint``."""
        field = _field_of(constraint)
        try:
            import llguidance
        except ImportError:
            raise Unsupported(
                "constrained decoding needs the llguidance package (pip install "
                "'lmserve-core[grammar]')",
                param=field,
            ) from None
        M = llguidance.LLMatcher
        try:
            if constraint.kind == "json_schema":
                # Non-strict schemas promise no enforcement: tolerate keywords llguidance
                # does not implement instead of refusing the request. Objects are closed
                # either way (closed_schema): left open, a small model adds keys until
                # the token bound.
                grammar = M.grammar_from_json_schema(
                    _closed_source(constraint.source or "{}"),
                    defaults=_JSON_OPTIONS,
                    overrides={"lenient": not constraint.strict},
                )
            elif constraint.kind == "json_object":
                grammar = M.grammar_from_json_schema(
                    json.dumps({"type": "object"}), defaults=_JSON_OPTIONS
                )
            elif constraint.kind == "regex":
                grammar = M.grammar_from_regex(constraint.source)
            elif constraint.kind == "lark":
                grammar = M.grammar_from_lark(constraint.source)
            else:
                raise Unsupported(f"unknown constraint kind {constraint.kind!r}")
        except ValueError as exc:
            raise InvalidRequest(
                f"invalid {constraint.kind} constraint: {exc}", param=field, code="invalid_grammar"
            ) from None
        return str(grammar)

    def _matcher(self, grammar: str, kind: str, field: str | None = None) -> Any:
        """A fresh matcher of ``grammar`` (from :meth:`_grammar`), tried on its first token;
        ``kind`` names the constraint in the error of a grammar that does not compile, and
        ``field`` is the request field that error and that of a grammar past llguidance's
        limits name."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"invalid {kind} constraint: {matcher.get_error()}",
                param=field,
                code="invalid_grammar",
            )
        self._try_first_token(matcher, field)
        return matcher

    def _try_first_token(self, matcher: Any, field: str | None) -> None:
        """Compute ``matcher``'s first mask and feed a copy of it one token the mask allows
        (not an end token): the lexer builds its first states, and a grammar too large for
        llguidance's limits (``a{1000000}``: too many expressions) fails now."""
        bits = np.empty((self._ll_tokenizer().vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if matcher.is_error():
            raise _grammar_limit(matcher, field, 0)
        allowed = np.flatnonzero(
            np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        )
        token = next((int(t) for t in allowed if int(t) not in self.stop_ids), None)
        if token is None:
            return
        probe = matcher.deep_copy()
        if not probe.consume_token(token) or probe.is_error():
            raise _grammar_limit(probe, field, 0)

    def _ll_tokenizer(self) -> Any:
        # Walking the vocabulary takes a while on large vocabularies: once per backend.
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                import llguidance

                self._grammar_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_GrammarVocabulary(self.tokenizer)),
                    eos_token=sorted(self.stop_ids),
                )
            return self._grammar_tokenizer

    # ------------------------------------------------------------------ generation

    def begin(self, request: NormalizedRequest, sink: EventSink) -> Generation:
        """Start generating ``request``: its prompt and sampler ready (the worker advances it
        with :meth:`step`). Raises an ``LmserveError`` for a request it cannot start. Its KV
        slot is taken when its prompt is first read, so a generation started with others of
        the same prompt (``n`` choices) finds their rows written and copies them; at most
        as many generations run as there are slots (the engine runs ``batch_size``)."""
        prepared = self._take_prepared(request)
        usage = Usage(prompt_tokens=len(prepared.tokens))
        gen = Generation(request, prepared, sink, usage)
        if sink.cancelled:
            gen.finish = Finish("cancelled", usage)
            return gen
        vocab = self.vocab_size
        gen.sampler = Sampler(
            resolve(
                request.sampling,
                self.conventions.sampling_for(self._thinking(request)),
                seed=self.settings.seed,
            ),
            vocab,
        )
        gen.decoder = self.tokenizer.stream_decoder(skip_special=True, keep=self.shown_ids)
        gen.out = _Output(
            sink,
            StopScanner(request.stop),
            self._router(request, prepared),
            self._reader(request, prepared),
        )
        if prepared.matcher is not None:
            n_words = (self._ll_tokenizer().vocab_size + 31) // 32
            gen.bits = np.empty(n_words, dtype=np.int32)
        gen.budget_close = self._budget_close(request, gen.out)
        if self.drafts is not None:
            gen.drafter = self.drafts.drafter()
            gen.pace = Pace(self.verify_cost, self.acceptance)
        return gen

    def step(self, gens: Sequence[Generation]) -> None:
        """Advance every unfinished generation of ``gens`` by one step: each one decoding
        samples its next token, and all of them write their rows in one weight pass; then
        the first one still reading its prompt prefills one chunk of it (small while others
        decode, so their tokens keep flowing). A generation that ends gets its ``finish``
        and gives its slot back; one failing ends only itself."""
        rows: list[tuple[Generation, list[int]]] = []
        waiting: list[Generation] = []
        for gen in gens:
            if gen.finish is not None:
                continue
            if not gen.prefilled:
                waiting.append(gen)
                continue
            tokens: list[int] | None
            if gen.todo:
                tokens, gen.todo = gen.todo, []
            else:
                tokens = self._guard(gen, self._advance, gen)
            if tokens:
                rows.append((gen, tokens))
        if len(rows) == 1 and rows[0][0].pace is not None and len(rows[0][1]) == 1:
            # decoding alone: try drafts
            self._guard(rows[0][0], self._speculate, *rows[0])
        elif rows:
            self._write_rows(rows)
        if waiting:
            self._guard(waiting[0], self._prefill_some, waiting[0], bool(rows))
            for gen in waiting[1:]:
                if gen.sink.cancelled:
                    self._end(gen, "cancelled")

    def _guard(self, gen: Generation, fn: Callable[..., _T], *args: Any) -> _T | None:
        """``fn(*args)``; an error ends ``gen`` alone, with an error event."""
        try:
            return fn(*args)
        except LmserveError as exc:
            gen.sink.emit(ErrorEvent(exc.message, exc.status, exc.kind))
        except Exception as exc:  # one bad request must not take the worker down
            log.exception("generate_failed", id=gen.request.id, model=self.model_id)
            gen.sink.emit(ErrorEvent(f"generation failed: {exc}", 500, "server_error"))
        self._end(gen, "error")
        return None

    def _prefill_some(self, gen: Generation, shared: bool) -> None:
        """Prefill the next chunk of ``gen``'s prompt: ``PREFILL_CHUNK`` tokens, or while
        others decode (``shared``) about ``PREFILL_SLICE_S`` seconds' worth."""
        if gen.sink.cancelled:
            self._end(gen, "cancelled")
            return
        prompt = gen.prepared.tokens
        if gen.slot is None:
            behind = None if self.fleet is None else self._fleet_prefix(gen.request)
            gen.slot, gen.usage.cached_tokens = self.slots.adopt(prompt, behind=behind)
            gen.slot.busy = True
            plan = getattr(gen.slot.cache, "plan", None)
            if plan is not None:  # a recurrent state: where to keep checkpoints of it
                plan(len(prompt), gen.prepared.shared)
            log.info(
                "kv_reuse", id=gen.request.id, tier=self.slots.last_tier,
                cached_tokens=gen.usage.cached_tokens, prompt_tokens=len(prompt),
            )
        slot = gen.slot
        pos = len(slot.tokens)
        chunk = prompt[pos : pos + (self._prefill_slice if shared else PREFILL_CHUNK)]
        started = time.perf_counter()
        logits = self.model.forward(slot.cache, chunk, pos)
        elapsed = time.perf_counter() - started
        if len(chunk) >= PREFILL_MIN_SLICE and elapsed > 0:
            fit = int(len(chunk) * PREFILL_SLICE_S / elapsed)
            self._prefill_slice = min(PREFILL_CHUNK, max(PREFILL_MIN_SLICE, fit))
        slot.tokens.extend(chunk)  # only rows the model has written join the shadow
        if len(slot.tokens) == len(prompt):
            gen.logits = logits
            gen.prefilled = True

    def _fleet_prefix(self, request: NormalizedRequest) -> PrefixRows:
        """The prefix of the documents ``request``'s conversation is served behind."""
        assert self.fleet is not None
        prompt = request.prompt
        if request.prompt_ids is not None:  # retrieved by the text the ids spell
            prompt = self.tokenizer.decode(request.prompt_ids) or " "
        chosen = self.fleet.select(request.messages, prompt)
        log.info(
            "fleet_selection", id=request.id, how=chosen.how,
            docs=self.fleet.names(chosen.docs), scores=[round(s, 4) for s in chosen.scores],
        )
        return chosen.prefix

    def _write_rows(self, rows: list[tuple[Generation, list[int]]]) -> None:
        """Write each generation's new tokens and keep the logits of its last one: in one
        weight pass when the model can (``forward_batch``), else one forward each."""
        batch = getattr(self.model, "forward_batch", None)
        limit = int(getattr(self.model, "n_batch", 0) or 0)
        groups: list[list[tuple[Generation, list[int]]]] = [[]]
        total = 0
        for row in rows:
            if groups[-1] and limit and total + len(row[1]) > limit:
                groups.append([])
                total = 0
            groups[-1].append(row)
            total += len(row[1])
        for group in groups:
            outs: list[np.ndarray] | None = None
            if batch is not None and len(group) > 1:
                try:
                    outs = batch([(g.kv.cache, toks, len(g.kv.tokens)) for g, toks in group])
                except Exception:  # find the failing one by running them one at a time
                    log.exception("batch_forward_failed", model=self.model_id, rows=len(group))
            if outs is not None:
                for (gen, tokens), logits in zip(group, outs, strict=True):
                    gen.logits = logits[-1]
                    gen.kv.tokens.extend(tokens)
                continue
            for gen, tokens in group:
                self._guard(gen, self._write_one, gen, tokens)

    def _write_one(self, gen: Generation, tokens: list[int]) -> None:
        slot = gen.kv
        gen.logits = self.model.forward(slot.cache, tokens, len(slot.tokens))
        slot.tokens.extend(tokens)

    def _speculate(self, gen: Generation, tokens: list[int]) -> None:
        """Write ``tokens`` (one sampled token) with drafts after it in one pass, and take
        as many of the drafts as sampling from the rows written accepts."""
        assert gen.pace is not None and gen.drafter is not None
        slot = gen.kv
        pace, drafter = gen.pace, gen.drafter
        most = min(
            gen.prepared.max_tokens - len(gen.generated),
            self.context_length - len(slot.tokens) - 1,
            MAX_DRAFT,
        )
        drafts: list[int] = []
        forced = self._grammar_drafts(gen, most)
        if forced:
            evidence: int | None = FORCED
            drafts = forced[: pace.budget(len(forced), evidence)]
        elif getattr(drafter, "free", False):
            # propose first: how many to verify depends on how the proposal was found
            if most > 0:
                drafts = drafter.propose(gen.prepared.tokens + gen.generated, most)
            evidence = getattr(drafter, "evidence", None)
            if drafts:
                drafts = drafts[: pace.budget(len(drafts), evidence)]
        else:
            evidence = None
            k = pace.budget(most)
            if k > 0:
                drafts = drafter.propose(gen.prepared.tokens + gen.generated, k)[:k]
        started = time.perf_counter()
        if not drafts:
            self._write_one(gen, tokens)
            self.verify_cost.observe(len(tokens), time.perf_counter() - started)
            return
        # a state that cannot be cut back is remembered, to return to if drafts are refused
        rewind = not slot.cache.kind.truncate
        if rewind:
            slot.cache.mark()  # type: ignore[attr-defined]
        rows = self.model.forward(slot.cache, tokens + drafts, len(slot.tokens), all_logits=True)
        self.verify_cost.observe(len(tokens) + len(drafts), time.perf_counter() - started)
        written = list(tokens)  # the rows that hold this sequence's tokens
        accepted = 0
        for i, draft in enumerate(drafts):
            step = self._advance(gen, rows[i], draft)
            if step is None:
                break  # ended (the rows past the shadow are not part of it)
            if step[0] != draft:
                gen.todo = step  # a correction: its row is written next step
                break
            accepted += 1
            written.append(draft)
            if len(step) > 1:
                gen.todo = step[1:]  # the tokens closing a think block follow it
                break
        else:
            gen.logits = rows[len(drafts)]
        pace.update(len(drafts), accepted, evidence)
        if rewind and len(written) < len(tokens) + len(drafts):
            # the state went past the rows kept: back to before the pass, then the kept rows
            self.model.forward(slot.cache, written, slot.cache.rewind())  # type: ignore[attr-defined]
        slot.tokens.extend(written)

    @staticmethod
    def _grammar_drafts(gen: Generation, most: int) -> list[int]:
        """Up to ``most`` tokens that the request's grammar allows alone from here (the keys
        and punctuation of a JSON schema): drafts that only the model's choosing another
        tokenization of the same text can reject."""
        matcher = gen.prepared.matcher
        if matcher is None or most <= 0 or matcher.is_stopped():
            return []
        return [int(t) for t in matcher.compute_ff_tokens()[:most]]

    def _advance(
        self, gen: Generation, logits: np.ndarray | None = None, draft: int | None = None
    ) -> list[int] | None:
        """Sample ``gen``'s next token from ``logits`` (its own by default), passing ``draft``
        on to the sampler, and pass its text on; the tokens to write next, or None when the
        generation ended."""
        if len(gen.generated) >= gen.prepared.max_tokens:
            self._end(gen, "length")
            return None
        if gen.sink.cancelled:
            self._end(gen, "cancelled")
            return None
        request, out, matcher = gen.request, gen.out, gen.prepared.matcher
        generated, budget = gen.generated, gen.prepared.max_tokens
        mask = None
        if matcher is not None:
            bits = gen.bits
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            if matcher.is_error():
                raise _grammar_limit(matcher, gen.prepared.grammar_field, len(generated))
            mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size]
            mask = mask.view(bool)
            if not mask.any():
                self._end(gen, "stop")  # the grammar allows nothing more (it is complete)
                return None
        if logits is None:
            logits, gen.logits = gen.logits, None
        assert logits is not None and out is not None
        tok = gen.sampler.sample(logits, generated, mask, logprobs=request.logprobs, draft=draft)
        generated.append(tok)
        if tok in self.stop_ids:
            self._end(gen, "stop")
            return None
        if gen.sampler.logprobs is not None:  # (an end-of-turn token has none: no text)
            gen.sink.emit(self._logprob_event(gen.sampler.logprobs, out))
        if out.push(gen.decoder.push(tok)):
            self._end(gen, "stop_sequence")
            return None
        if out.calls and not request.parallel_tool_calls:
            self._end(gen, "stop")  # one call per reply: the rest is not wanted
            return None
        if matcher is not None:
            if not matcher.consume_token(tok):
                # the token was in the grammar's mask: the grammar itself gave out (a limit)
                raise _grammar_limit(matcher, gen.prepared.grammar_field, len(generated) - 1)
            if matcher.is_stopped():
                self._end(gen, "stop")
                return None
        if len(generated) >= budget:
            self._end(gen, "length")
            return None
        step = [tok]
        answer = self.conventions.continuation
        if answer is not None and matcher is None:
            written = list(answer(generated))[: budget - len(generated)]
            if written:
                generated.extend(written)
                step += written
                for extra in written:
                    if out.push(gen.decoder.push(extra), sampled=False):
                        self._end(gen, "stop_sequence")
                        return None
                if len(generated) >= budget:
                    self._end(gen, "length")
                    return None
        close = gen.budget_close
        if close is not None and out.reasoning_spent(close[0]):
            # The reasoning budget is spent: close the think block in the model's own
            # sequence, so the answer follows it.
            closing = close[1][: budget - len(generated)]
            gen.budget_close = None
            for extra in closing:
                out.push(gen.decoder.push(extra), sampled=False)
            generated.extend(closing)
            step += closing
            if len(generated) >= budget:
                self._end(gen, "length")  # no row was written for these: the shadow stays exact
                return None
        return step

    def _logprob_event(
        self, scored: tuple[int, float, list[tuple[int, float]]], out: _Output
    ) -> TokenLogprob:
        tok, logprob, top = scored

        def alt(token_id: int, value: float) -> TokenAlternative:
            raw = self.tokenizer.token_bytes(token_id)
            return TokenAlternative(raw.decode("utf-8", errors="replace"), value, list(raw))

        reasoning = out.router is not None and out.router.in_reasoning
        return TokenLogprob(alt(tok, logprob), [alt(i, v) for i, v in top], reasoning)

    def _end(self, gen: Generation, reason: FinishReason) -> None:
        """Finish ``gen``: release what its filters hold back, set its ``finish``, free its
        slot."""
        if gen.finish is not None:
            return
        if gen.slot is not None:
            gen.slot.busy = False
        if gen.drafter is not None:
            gen.drafter.close()
        if gen.pace is not None and gen.pace.proposed:
            log.info(
                "speculation",
                id=gen.request.id,
                drafts=self.drafts.name if self.drafts is not None else None,
                proposed=gen.pace.proposed,
                accepted=gen.pace.accepted,
                row_cost=round(self.verify_cost.row, 3),
            )
        usage, out = gen.usage, gen.out
        gen.logits = None
        if reason == "error" or out is None:
            gen.finish = Finish(reason, usage)
            return
        try:
            if reason != "stop_sequence":
                out.push(gen.decoder.flush())
            out.finish(cut=reason == "length")
        except Exception:  # the reply is over either way; its text is already out
            log.exception("finish_failed", id=gen.request.id, model=self.model_id)
        usage.completion_tokens = len(gen.generated)
        usage.reasoning_tokens = out.reasoning_tokens
        if reason == "stop_sequence":
            gen.finish = Finish("stop_sequence", usage, stop_sequence=out.scanner.fired)
        elif out.calls and reason == "stop":
            gen.finish = Finish("tool_calls", usage)
        else:
            gen.finish = Finish(reason, usage)

    def _budget_close(
        self, request: NormalizedRequest, out: _Output
    ) -> tuple[int, list[int]] | None:
        """(budget, tokens that close the think block) when reasoning is capped."""
        markers = self.conventions.think
        if request.reasoning_budget is None or markers is None or out.router is None:
            return None
        closing = self.tokenizer.encode(markers.close + "\n\n", parse_special=True)
        return max(0, int(request.reasoning_budget)), closing

    def _reader(self, request: NormalizedRequest, prepared: _Prepared) -> ToolCallParser | None:
        """The parser of the reply's text: the tool convention's when tools are in play, else
        the family's reply reader, if it has one."""
        if prepared.tools is not None:
            return prepared.tools.parser(request.tools)
        reader = self.conventions.reply_reader
        return None if reader is None else reader.parser(None)

    def _router(self, request: NormalizedRequest, prepared: _Prepared) -> ThinkRouter | None:
        markers = self.conventions.think
        if markers is None or prepared.matcher is not None or request.prompt is not None:
            return None
        return ThinkRouter(markers, inside=prepared.think_inside)

    def _check_ids(self, ids: Sequence[int], param: str | None = None) -> None:
        # a prompt's ids index the model's embeddings too
        n = self.tokenizer.vocab_size if param is None else self.vocab_size
        for tid in ids:
            if not 0 <= int(tid) < n:
                raise InvalidRequest(f"token id {tid} is outside the vocabulary [0, {n})", param=param)


# general.sampling.* keys (as llama.cpp's converter writes a model's generation_config)
# and the SamplingDefaults field each sets.
_FILE_SAMPLING = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repeat_penalty",
}


def file_sampling(gguf: GGUFFile, conventions: FamilyConventions) -> FamilyConventions:
    """``conventions`` with the sampling a file recommends (``general.sampling.*``) in place
    of the family's, thinking or not; values out of range are ignored."""
    found: dict[str, Any] = {}  # SamplingDefaults fields, each its type
    for key, name in _FILE_SAMPLING.items():
        value = gguf.metadata.get(f"general.sampling.{key}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            continue
        if (name == "top_k" and (value < 0 or value != int(value))) or (
            name in ("top_p", "min_p") and not 0.0 <= value <= 1.0
        ) or (name in ("temperature", "repeat_penalty") and value < 0.0):
            continue
        found[name] = int(value) if name == "top_k" else float(value)
    if not found:
        return conventions
    log.info("file_sampling", **found)
    thinking = conventions.thinking_sampling
    return replace(
        conventions,
        sampling=replace(conventions.sampling, **found),
        thinking_sampling=None if thinking is None else replace(thinking, **found),
    )


def _closed_source(source: str) -> str:
    """A JSON schema's text with its objects closed (``tools.closed_schema``); text that is
    no JSON stays as it is, for the grammar compiler to refuse."""
    try:
        schema = json.loads(source)
    except ValueError:
        return source
    return json.dumps(closed_schema(schema), ensure_ascii=False)


def _either(first: str, second: str) -> str:
    """An llguidance grammar whose sentences are those of ``first`` or of ``second`` (each
    as :meth:`GGUFChatBackend._grammar` gives it: a top-level grammar's JSON, or lark)."""

    def part(grammar: str, name: str) -> dict[str, Any]:
        try:
            top = json.loads(grammar)
        except ValueError:
            return {"name": name, "lark_grammar": grammar}
        parts = top.get("grammars") if isinstance(top, dict) else None
        if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
            raise ValueError("a grammar of several parts cannot be joined")
        return {**parts[0], "name": name}

    lark = {"lark_grammar": "start: @first | @second"}
    return json.dumps({"grammars": [lark, part(first, "first"), part(second, "second")]})


# The field a constraint came from when the dialect did not say (Chat Completions' names).
_CONSTRAINT_FIELDS = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "regex": "regex",
    "lark": "lark",
}


def _field_of(constraint: Constraint) -> str:
    """The request field ``constraint`` came from."""
    return constraint.field or _CONSTRAINT_FIELDS.get(constraint.kind, "response_format")


def _grammar_field(request: NormalizedRequest) -> str | None:
    """The field the grammar of ``request``'s reply comes from: a forced call's, else its
    output constraint's (also when calls may come instead)."""
    if _forced(request):
        return "tool_choice"
    return _field_of(request.constraint) if request.constraint is not None else None


def _grammar_limit(matcher: Any, field: str | None, tokens: int) -> InvalidRequest:
    """The 400 of a grammar that llguidance gave up on ``tokens`` tokens into the reply
    (a parser or lexer limit): the request's own content, named by its field."""
    detail = (matcher.get_error() or "the grammar failed").strip().splitlines()[0]
    where = "at the start of the reply" if tokens == 0 else f"after {tokens} tokens of the reply"
    name = f"'{field}'" if field else "the grammar"
    return InvalidRequest(
        f"{name}: the grammar exceeded a parser limit {where}: {detail}",
        param=field,
        code="grammar_too_complex",
    )


def _forced(request: NormalizedRequest) -> bool:
    """True when the request forces a tool call (required, or a named tool)."""
    return bool(request.tools) and request.tool_choice.mode in (
        ToolChoiceMode.REQUIRED,
        ToolChoiceMode.NAMED,
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


class _Output:
    """Text of the reply on its way out, through the filters in order: stop strings, the
    reasoning router, the tool-call parser; then events."""

    __slots__ = ("calls", "parser", "reasoning_tokens", "router", "scanner", "sink")

    def __init__(
        self,
        sink: EventSink,
        scanner: StopScanner,
        router: ThinkRouter | None,
        parser: ToolCallParser | None,
    ) -> None:
        self.sink = sink
        self.scanner = scanner
        self.router = router
        self.parser = parser
        self.reasoning_tokens = 0
        self.calls = 0

    def push(self, text: str, *, sampled: bool = True) -> bool:
        """Send one token's text on; True when a stop string fired. Tokens the server wrote
        into the reply itself (``sampled=False``) do not count as reasoning."""
        if sampled and self.router is not None and self.router.in_reasoning:
            self.reasoning_tokens += 1
        if not text:
            return False
        out, fired = self.scanner.feed(text)
        self._route(out)
        return fired is not None

    def reasoning_spent(self, budget: int) -> bool:
        """True while in the think block with ``budget`` reasoning tokens used up."""
        return (
            self.router is not None
            and self.router.in_reasoning
            and self.reasoning_tokens >= budget
        )

    def finish(self, *, cut: bool = False) -> None:
        """The reply ended: release everything held back. ``cut``: the token bound ended it,
        so a call it cut off comes back as a partial call and its notation never as text (a
        parser without ``cut`` flushes)."""
        self._route(self.scanner.flush())
        if self.router is not None:
            self._send(*self.router.flush())
        if self.parser is not None:
            release = getattr(self.parser, "cut", None) if cut else None
            text, calls = release() if release is not None else self.parser.flush()
            self._reply(text, calls)

    def _route(self, text: str) -> None:
        if not text:
            return
        if self.router is None:
            self._send("", text)
        else:
            self._send(*self.router.feed(text))

    def _send(self, reasoning: str, reply: str) -> None:
        if reasoning:
            self.sink.emit(ReasoningDelta(reasoning))
        if reply:
            if self.parser is None:
                self.sink.emit(TextDelta(reply))
            else:
                self._reply(*self.parser.feed(reply))

    def _reply(self, text: str, calls: list[ToolCall]) -> None:
        if text:
            self.sink.emit(TextDelta(text))
        for call in calls:
            self.calls += 1
            self.sink.emit(ToolCallEvent(call))


class _GrammarVocabulary:
    """The vocabulary as llguidance's ``TokenizerWrapper`` reads it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        n = tokenizer.vocab_size
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")  # tells the wrapper to hand over str
        return self._tokenizer.encode(text, add_special=False)


def _close(obj: object) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()
