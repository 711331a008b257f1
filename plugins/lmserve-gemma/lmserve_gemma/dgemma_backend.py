"""DiffusionGemma served: the generic chat path (prompt, slots, stop strings, reasoning, the
dialects' events) with block diffusion in place of token-by-token decoding.

A generation reads its prompt causally (the slot's prefix, reused across requests as any
family's), then denoises one block at a time (:class:`~.dgemma_sampler.BlockDenoiser`, one
denoising step per engine step, so others' requests and cancellation interleave). A finished
block is committed: cut before its first end-of-sequence id, sent as ONE text delta (stop
strings and the reasoning router see its text), counted in the usage, and, unless the reply
ends there, read causally into the prefix for the next block.

``max_tokens`` bounds the committed tokens: the last block is cut to it (each block costs a
whole canvas of work, ``canvas_length`` positions of context). Grammars and tools are
refused with a 400 naming the field (the reference offers neither), and so are
log-probabilities. The sampler's parameters
are the file's ``diffusion.eb_*``, each overridable by the request's ``diffusion`` object
(``max_steps``, ``t_min``, ``t_max``, ``entropy_bound``, ``stability_threshold``,
``confidence_threshold``); a request's ``seed`` makes its reply reproducible; the other
sampling fields are ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmserve_core.chat_schedule import Generation, Scheduler
from lmserve_core.errors import InvalidRequest
from lmserve_core.events import EventSink, FinishReason
from lmserve_core.gguf_chat import GGUFChatBackend
from lmserve_core.request import NormalizedRequest

from .dgemma_config import EntropyBound
from .dgemma_model import DiffusionGemmaModel
from .dgemma_sampler import BlockDenoiser, trim_at_eos


@dataclass(eq=False)
class _Blocks:
    """A generation's block diffusion: its random source and the block being denoised."""

    rng: np.random.Generator
    params: EntropyBound
    block: BlockDenoiser | None = None
    pos: int = 0  # where the block's canvas sits


class BlockScheduler(Scheduler):
    """Steps DiffusionGemma's generations: the generic prompt chunks
    (:meth:`~lmserve_core.chat_schedule.Scheduler.prefill_some`), then one denoising step
    (or a committed block) per engine step; ``guard`` and ``end`` as the generic path's."""

    chat: DiffusionChatBackend

    def __init__(self, chat: GGUFChatBackend) -> None:
        super().__init__(chat)
        self._blocks: dict[Generation, _Blocks] = {}

    def begin(self, request: NormalizedRequest, sink: EventSink) -> Generation:
        gen = super().begin(request, sink)
        if gen.finish is None:
            seed = request.sampling.seed
            if seed is None:
                seed = self.chat.settings.seed
            params = self.chat.sampler_params(request)
            self._blocks[gen] = _Blocks(np.random.default_rng(seed), params)
        return gen

    def step(self, gens: Sequence[Generation]) -> None:
        """One step of every unfinished generation: a prompt chunk for one still reading
        its prompt, one denoising step (or a committed block) for the others."""
        for gen in gens:
            if gen.finish is not None:
                continue
            if not gen.prefilled:
                self.guard(gen, self.prefill_some, gen, False)
            else:
                self.guard(gen, self._diffuse, gen)

    def _diffuse(self, gen: Generation) -> None:
        if gen.sink.cancelled:
            self.end(gen, "cancelled")
            return
        chat, state = self.chat, self._blocks[gen]
        if state.block is None:
            slot, canvas = gen.kv, chat.model.config.canvas_length
            state.pos = len(slot.tokens)
            if len(gen.generated) >= gen.prepared.max_tokens or (
                state.pos + canvas > chat.context_length
            ):
                self.end(gen, "length")
                return
            pos, vocab, model = state.pos, chat.vocab_size, chat.model

            def denoise(ids: np.ndarray, sc: np.ndarray | None) -> np.ndarray:
                full = None if sc is None else self._padded(sc)
                return model.denoise(slot.cache, ids.tolist(), pos, full)[:, :vocab]

            state.block = BlockDenoiser(denoise, state.params, canvas, vocab, state.rng)
        if state.block.step():
            tokens, state.block = state.block.tokens, None
            self._commit(gen, tokens, state.pos)

    def _padded(self, logits: np.ndarray) -> np.ndarray:
        """Logits over the tokenizer's ids as the model's rows (padding rows never drawn)."""
        n = int(self.chat.model.n_vocab)
        if logits.shape[1] == n:
            return logits
        out = np.full((len(logits), n), -np.inf, np.float32)
        out[:, : logits.shape[1]] = logits
        return out

    def _commit(self, gen: Generation, block: list[int], pos: int) -> None:
        """The block joins the reply (one delta) and, unless the reply ends, the prefix."""
        kept, ended = trim_at_eos(block, self.chat.stop_ids)
        room = gen.prepared.max_tokens - len(gen.generated)
        cut = len(kept) > room
        kept = kept[:room]
        gen.generated.extend(kept)
        out = gen.out
        assert out is not None
        thinking = out.router is not None and out.router.in_reasoning
        text = "".join(gen.decoder.push(t) for t in kept)
        fired = out.push(text)
        if thinking and kept:
            out.reasoning_tokens += len(kept) - 1  # push counted the block once
        if fired:
            self.end(gen, "stop_sequence")
        elif ended:
            self.end(gen, "stop")
        elif cut or len(gen.generated) >= gen.prepared.max_tokens:
            self.end(gen, "length")
        else:
            self.chat.model.forward(gen.kv.cache, kept, pos)
            gen.kv.tokens.extend(kept)

    def end(self, gen: Generation, reason: FinishReason) -> None:
        super().end(gen, reason)
        self._blocks.pop(gen, None)


class DiffusionChatBackend(GGUFChatBackend):
    """The chat backend of ``diffusion-gemma`` files: the generic preparation and output,
    its own :class:`BlockScheduler`."""

    model: DiffusionGemmaModel
    scheduler_class = BlockScheduler
    speculates = False  # a block is not decoded token by token: nothing to draft

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        canvas = self.model.config.canvas_length
        if canvas > self.model.n_batch:
            raise ValueError(f"a canvas of {canvas} does not fit the batch of "
                             f"{self.model.n_batch} (--batch)")
        # the block sampler draws from the denoiser's own distribution: no biases
        self.capabilities = dataclasses.replace(self.capabilities, logit_bias=False)

    def validate(self, request: NormalizedRequest) -> None:
        """The generic checks, after refusing what block diffusion cannot honour (tools and
        constraints the dialects refuse: ``Capabilities.refuses_tools``)."""
        if request.logprobs is not None:
            raise InvalidRequest("'logprobs': DiffusionGemma does not report log-probabilities "
                                 "(a block is not drawn token by token)", param="logprobs")
        self.sampler_params(request)
        super().validate(request)

    def sampler_params(self, request: NormalizedRequest) -> EntropyBound:
        """The file's sampler parameters with the request's ``diffusion`` overrides."""
        params = self.model.config.sampler
        asked = request.sampling.diffusion
        if asked is None:
            return params
        changes = {f.name: getattr(asked, f.name) for f in dataclasses.fields(asked)
                   if getattr(asked, f.name) is not None}
        if "max_steps" in changes:
            changes["max_denoising_steps"] = changes.pop("max_steps")
        try:
            return params.replace(**changes)
        except ValueError as exc:
            raise InvalidRequest(f"'diffusion': {exc}", param="diffusion") from None
