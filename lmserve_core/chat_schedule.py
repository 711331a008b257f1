"""Scheduling generations: starting one (``begin``), then advancing all of them a step at
a time (``step``) — prompts read in chunks into their KV slots, each decoding generation's
next token sampled and its row written, all rows in one weight pass when the model can.

Per request: adopt a KV slot (reusing the longest shared token prefix), prefill the rest in
chunks, then decode one token at a time — sample, stop on end-of-generation tokens, stop
strings, a finished grammar or the token budget — streaming whole-code-point text as it
goes (:mod:`lmserve_core.chat_output`). A generation decoding alone may speculate
(:class:`~lmserve_core.speculative.Speculation`).

:class:`Scheduler` is the part a family that does not decode token by token replaces
(``GGUFChatBackend.scheduler_class``): :meth:`Scheduler.guard`,
:meth:`Scheduler.prefill_some` and :meth:`Scheduler.end` are its building blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import structlog

from .cartridge.serve import PrefixRows
from .chat_grammar import grammar_limit
from .chat_output import Output
from .chat_prepare import Prepared
from .errors import LmserveError
from .events import ErrorEvent, EventSink, Finish, FinishReason, Usage
from .kv_slots import KVSlot
from .model import KVCache
from .request import NormalizedRequest
from .sampling import Sampler, resolve
from .speculative import Drafter, Pace
from .tokenizer import StreamDecoder

if TYPE_CHECKING:
    from .gguf_chat import GGUFChatBackend

log = structlog.get_logger("lmserve.gguf_chat")

_T = TypeVar("_T")

PREFILL_CHUNK = 512  # most prompt tokens read in one step
# While other generations decode, a step reads about this many seconds of prompt, and at
# least PREFILL_MIN_SLICE tokens: a long prompt arriving mid-stream delays the others' next
# token by about this much, not by its whole prefill. The slice follows the time the last
# chunk took (a chunk's cost grows with its position).
PREFILL_SLICE_S = 0.2
PREFILL_MIN_SLICE = 32


@dataclass(eq=False, slots=True)
class Generation:
    """One request being generated: its prompt, slot, sampler, filters and progress.

    ``logits`` are those of the last row written, while a token is to be sampled from them;
    ``todo`` holds tokens sampled whose rows are still to be written (a correction after a
    rejected draft, or the tokens that close a think block). ``finish`` is set when it has
    ended.
    """

    request: NormalizedRequest
    prepared: Prepared
    sink: EventSink
    usage: Usage
    slot: KVSlot[KVCache] | None = None
    sampler: Sampler = field(init=False)
    decoder: StreamDecoder = field(init=False)
    out: Output | None = None
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


class Scheduler:
    """Starts and steps the generations of one backend (``chat``), reading its model, slots,
    parts and settings."""

    def __init__(self, chat: GGUFChatBackend) -> None:
        self.chat = chat
        self.prefill_slice = 2 * PREFILL_MIN_SLICE  # prompt tokens read per shared step

    def begin(self, request: NormalizedRequest, sink: EventSink) -> Generation:
        """Start generating ``request``: its prompt and sampler ready (the worker advances it
        with :meth:`step`). Raises an ``LmserveError`` for a request it cannot start. Its KV
        slot is taken when its prompt is first read, so a generation started with others of
        the same prompt (``n`` choices) finds their rows written and copies them; at most
        as many generations run as there are slots (the engine runs ``batch_size``)."""
        chat = self.chat
        prepared = chat.preparation.take(request)
        usage = Usage(prompt_tokens=len(prepared.tokens))
        gen = Generation(request, prepared, sink, usage)
        if sink.cancelled:
            gen.finish = Finish("cancelled", usage)
            return gen
        vocab = chat.vocab_size
        gen.sampler = Sampler(
            resolve(
                request.sampling,
                chat.conventions.sampling_for(chat.preparation.thinking(request)),
                seed=chat.settings.seed,
            ),
            vocab,
        )
        gen.decoder = chat.tokenizer.stream_decoder(skip_special=True, keep=chat.shown_ids)
        gen.out = chat.outputs.open(sink, request, prepared)
        if prepared.matcher is not None:
            gen.bits = chat.grammars.mask_words()
        gen.budget_close = chat.outputs.budget_close(request, gen.out)
        if chat.drafts is not None:
            gen.drafter = chat.drafts.drafter()
            gen.pace = Pace(chat.verify_cost, chat.acceptance)
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
                tokens = self.guard(gen, self.advance, gen)
            if tokens:
                rows.append((gen, tokens))
        if len(rows) == 1 and rows[0][0].pace is not None and len(rows[0][1]) == 1:
            # decoding alone: try drafts
            self.guard(rows[0][0], self.chat.speculation.speculate, *rows[0])
        elif rows:
            self.write_rows(rows)
        if waiting:
            self.guard(waiting[0], self.prefill_some, waiting[0], bool(rows))
            for gen in waiting[1:]:
                if gen.sink.cancelled:
                    self.end(gen, "cancelled")

    def guard(self, gen: Generation, fn: Callable[..., _T], *args: Any) -> _T | None:
        """``fn(*args)``; an error ends ``gen`` alone, with an error event."""
        try:
            return fn(*args)
        except LmserveError as exc:
            gen.sink.emit(ErrorEvent(exc.message, exc.status, exc.kind))
        except Exception as exc:  # one bad request must not take the worker down
            log.exception("generate_failed", id=gen.request.id, model=self.chat.model_id)
            gen.sink.emit(ErrorEvent(f"generation failed: {exc}", 500, "server_error"))
        self.end(gen, "error")
        return None

    def prefill_some(self, gen: Generation, shared: bool) -> None:
        """Prefill the next chunk of ``gen``'s prompt: ``PREFILL_CHUNK`` tokens, or while
        others decode (``shared``) about ``PREFILL_SLICE_S`` seconds' worth."""
        if gen.sink.cancelled:
            self.end(gen, "cancelled")
            return
        prompt = gen.prepared.tokens
        if gen.slot is None:
            behind = None if self.chat.fleet is None else self.fleet_prefix(gen.request)
            gen.slot, gen.usage.cached_tokens = self.chat.slots.adopt(prompt, behind=behind)
            gen.slot.busy = True
            plan = getattr(gen.slot.cache, "plan", None)
            if plan is not None:  # a recurrent state: where to keep checkpoints of it
                plan(len(prompt), gen.prepared.shared)
            log.info(
                "kv_reuse",
                id=gen.request.id,
                tier=self.chat.slots.last_tier,
                cached_tokens=gen.usage.cached_tokens,
                prompt_tokens=len(prompt),
            )
        slot = gen.slot
        pos = len(slot.tokens)
        chunk = prompt[pos : pos + (self.prefill_slice if shared else PREFILL_CHUNK)]
        started = time.perf_counter()
        logits = self.chat.model.forward(slot.cache, chunk, pos)
        elapsed = time.perf_counter() - started
        if len(chunk) >= PREFILL_MIN_SLICE and elapsed > 0:
            fit = int(len(chunk) * PREFILL_SLICE_S / elapsed)
            self.prefill_slice = min(PREFILL_CHUNK, max(PREFILL_MIN_SLICE, fit))
        slot.tokens.extend(chunk)  # only rows the model has written join the shadow
        if len(slot.tokens) == len(prompt):
            gen.logits = logits
            gen.prefilled = True

    def fleet_prefix(self, request: NormalizedRequest) -> PrefixRows:
        """The prefix of the documents ``request``'s conversation is served behind."""
        assert self.chat.fleet is not None
        prompt = request.prompt
        if request.prompt_ids is not None:  # retrieved by the text the ids spell
            prompt = self.chat.tokenizer.decode(request.prompt_ids) or " "
        chosen = self.chat.fleet.select(request.messages, prompt)
        log.info(
            "fleet_selection",
            id=request.id,
            how=chosen.how,
            docs=self.chat.fleet.names(chosen.docs),
            scores=[round(s, 4) for s in chosen.scores],
        )
        return chosen.prefix

    def write_rows(self, rows: list[tuple[Generation, list[int]]]) -> None:
        """Write each generation's new tokens and keep the logits of its last one: in one
        weight pass when the model can (``forward_batch``), else one forward each."""
        batch = getattr(self.chat.model, "forward_batch", None)
        limit = int(getattr(self.chat.model, "n_batch", 0) or 0)
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
                    log.exception("batch_forward_failed", model=self.chat.model_id, rows=len(group))
            if outs is not None:
                for (gen, tokens), logits in zip(group, outs, strict=True):
                    gen.logits = logits[-1]
                    gen.kv.tokens.extend(tokens)
                continue
            for gen, tokens in group:
                self.guard(gen, self.write_one, gen, tokens)

    def write_one(self, gen: Generation, tokens: list[int]) -> None:
        slot = gen.kv
        gen.logits = self.chat.model.forward(slot.cache, tokens, len(slot.tokens))
        slot.tokens.extend(tokens)

    def advance(
        self, gen: Generation, logits: np.ndarray | None = None, draft: int | None = None
    ) -> list[int] | None:
        """Sample ``gen``'s next token from ``logits`` (its own by default), passing ``draft``
        on to the sampler, and pass its text on; the tokens to write next, or None when the
        generation ended."""
        if len(gen.generated) >= gen.prepared.max_tokens:
            self.end(gen, "length")
            return None
        if gen.sink.cancelled:
            self.end(gen, "cancelled")
            return None
        request, out, matcher = gen.request, gen.out, gen.prepared.matcher
        generated, budget = gen.generated, gen.prepared.max_tokens
        mask = None
        if matcher is not None:
            bits = gen.bits
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            if matcher.is_error():
                raise grammar_limit(matcher, gen.prepared.grammar_field, len(generated))
            mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.chat.vocab_size]
            mask = mask.view(bool)
            if not mask.any():
                self.end(gen, "stop")  # the grammar allows nothing more (it is complete)
                return None
        if logits is None:
            logits, gen.logits = gen.logits, None
        assert logits is not None and out is not None
        tok = gen.sampler.sample(logits, generated, mask, logprobs=request.logprobs, draft=draft)
        generated.append(tok)
        if tok in self.chat.stop_ids:
            self.end(gen, "stop")
            return None
        if gen.sampler.logprobs is not None:  # (an end-of-turn token has none: no text)
            gen.sink.emit(self.chat.outputs.logprob_event(gen.sampler.logprobs, out))
        if out.push(gen.decoder.push(tok)):
            self.end(gen, "stop_sequence")
            return None
        if out.calls and not request.parallel_tool_calls:
            self.end(gen, "stop")  # one call per reply: the rest is not wanted
            return None
        if matcher is not None:
            if not matcher.consume_token(tok):
                # the token was in the grammar's mask: the grammar itself gave out (a limit)
                raise grammar_limit(matcher, gen.prepared.grammar_field, len(generated) - 1)
            if matcher.is_stopped():
                self.end(gen, "stop")
                return None
        if len(generated) >= budget:
            self.end(gen, "length")
            return None
        step = [tok]
        answer = self.chat.conventions.continuation
        if answer is not None and matcher is None:
            written = list(answer(generated))[: budget - len(generated)]
            if written:
                generated.extend(written)
                step += written
                for extra in written:
                    if out.push(gen.decoder.push(extra), sampled=False):
                        self.end(gen, "stop_sequence")
                        return None
                if len(generated) >= budget:
                    self.end(gen, "length")
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
                self.end(gen, "length")  # no row was written for these: the shadow stays exact
                return None
        return step

    def end(self, gen: Generation, reason: FinishReason) -> None:
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
                drafts=self.chat.drafts.name if self.chat.drafts is not None else None,
                proposed=gen.pace.proposed,
                accepted=gen.pace.accepted,
                row_cost=round(self.chat.verify_cost.row, 3),
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
            log.exception("finish_failed", id=gen.request.id, model=self.chat.model_id)
        usage.completion_tokens = len(gen.generated)
        usage.reasoning_tokens = out.reasoning_tokens
        if reason == "stop_sequence":
            gen.finish = Finish("stop_sequence", usage, stop_sequence=out.scanner.fired)
        elif out.calls and reason == "stop":
            gen.finish = Finish("tool_calls", usage)
        else:
            gen.finish = Finish(reason, usage)
