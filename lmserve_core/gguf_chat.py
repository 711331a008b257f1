"""The generic GGUF chat path: a Backend built from a family's forward pass.

Tokenizer and chat template come from the GGUF metadata; the family supplies the forward
pass and its conventions. :class:`GGUFChatBackend` composes parts a reader can take one at
a time:

- set-up (:mod:`lmserve_core.chat_setup`): the cartridge or fleet prefix, tokenizer and
  template, the KV slots under the memory guard, the disk tier, the draft source;
- preparation (:mod:`lmserve_core.chat_prepare`, grammars in
  :mod:`lmserve_core.chat_grammar`): the prompt rendered and tokenized, shared prefixes, the
  tool plan and the reply's grammar;
- scheduling (:mod:`lmserve_core.chat_schedule`): ``begin`` and ``step``, prompt chunks,
  sampling and row writes — the part a family that does not decode token by token replaces
  (:attr:`GGUFChatBackend.scheduler_class`);
- speculation (:class:`lmserve_core.speculative.Speculation`): drafts verified in one pass;
- output (:mod:`lmserve_core.chat_output`): stop strings, reasoning routing, tool-call
  parsing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import structlog

from .backend import Capabilities, ServerSettings
from .chat_grammar import Grammars
from .chat_output import Output, Outputs
from .chat_prepare import Preparation, Prepared
from .chat_schedule import Generation, Scheduler
from .chat_setup import close_quietly, file_sampling, set_up
from .chat_template import ChatTemplate
from .errors import LmserveError
from .events import ErrorEvent, EventSink, Finish, Usage
from .gguf_file import GGUFFile
from .model import FamilyConventions, ForwardModel
from .request import NormalizedRequest
from .speculative import Acceptance, Speculation, VerifyCost
from .tokenizer import Tokenizer

log = structlog.get_logger("lmserve.gguf_chat")

__all__ = [
    "GGUFChatBackend",
    "Generation",
    "Output",
    "Prepared",
    "Scheduler",
    "Tokenizer",
    "file_sampling",
]


class GGUFChatBackend:
    """A :class:`~lmserve_core.backend.Backend` over a GGUF file and a ``ForwardModel``.

    Its parts: ``preparation`` (:class:`~lmserve_core.chat_prepare.Preparation`),
    ``grammars``, ``outputs``, ``speculation`` and ``scheduler`` (an instance of
    ``scheduler_class``). A subclass replaces how generations are stepped with its own
    :class:`~lmserve_core.chat_schedule.Scheduler` subclass in ``scheduler_class``, and sets
    ``speculates`` False when drafts have no use.
    """

    scheduler_class: ClassVar[type[Scheduler]] = Scheduler
    speculates: ClassVar[bool] = True  # load the draft source the settings name

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
        self.settings = settings
        wired = set_up(
            gguf=gguf,
            model=model,
            conventions=conventions,
            settings=settings,
            model_id=model_id,
            speculate=self.speculates,
        )
        self.model_id = wired.model_id
        self.model = wired.model
        self.conventions = wired.conventions
        self.context_length = wired.context_length
        self.tokenizer = wired.tokenizer
        self.prefix = wired.prefix
        self.fleet = wired.fleet
        self.vocab_size = wired.vocab_size
        self.stop_ids = wired.stop_ids
        self.shown_ids = wired.shown_ids
        self.batch_size = wired.batch_size
        self.kv_slots = wired.kv_slots
        self.kv_bytes = wired.kv_bytes
        self.cache_kind = wired.cache_kind
        self.slots = wired.slots
        self.drafts = wired.drafts
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.stop_ids)
        self.preparation = Preparation(
            name=name,
            model_id=self.model_id,
            tokenizer=self.tokenizer,
            template=wired.template,
            conventions=self.conventions,
            capabilities=wired.capabilities,
            grammars=self.grammars,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            checkpointed=not self.cache_kind.truncate,
        )
        self.outputs = Outputs(self.conventions, self.tokenizer)
        # what verify rows cost (calibrated here, checked by the passes of generations that
        # speculate) and how each kind of draft fares, for every generation's Pace
        self.verify_cost = VerifyCost()
        self.acceptance = Acceptance()
        self.speculation = Speculation(self)
        self.scheduler = self.scheduler_class(self)
        if self.drafts is not None:
            self.speculation.calibrate()

    @property
    def capabilities(self) -> Capabilities:
        """What this backend does (the preparation's, which checks requests against it)."""
        return self.preparation.capabilities

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        self.preparation.capabilities = value

    @property
    def template(self) -> ChatTemplate:
        """The chat template prompts are rendered with."""
        return self.preparation.template

    @template.setter
    def template(self, value: ChatTemplate) -> None:
        self.preparation.template = value

    # ------------------------------------------------------------------ Backend protocol

    def validate(self, request: NormalizedRequest) -> None:
        """Render and tokenize the prompt, check it fits, compile any grammar."""
        prepared = self.preparation.prepare(request)
        request.prompt_tokens = len(prepared.tokens)
        self.preparation.remember(prepared)

    def begin(self, request: NormalizedRequest, sink: EventSink) -> Generation:
        """Start generating ``request`` (:meth:`Scheduler.begin`)."""
        return self.scheduler.begin(request, sink)

    def step(self, gens: Sequence[Generation]) -> None:
        """Advance the unfinished generations of ``gens`` one step (:meth:`Scheduler.step`)."""
        self.scheduler.step(gens)

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

    def count_tokens(self, request: NormalizedRequest) -> int:
        """Prompt tokens of ``request`` exactly as ``generate`` would feed them."""
        return self.preparation.count_tokens(request)

    def tokenize(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text``."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        self.preparation.check_ids(ids)
        return self.tokenizer.decode(ids)

    def token_piece(self, token_id: int) -> bytes:
        """The raw bytes of one token."""
        self.preparation.check_ids([token_id])
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
                close_quietly(slot.cache)
        self.slots.clear()
        close_quietly(self.drafts)
        close_quietly(self.model)
        close_quietly(self.gguf)
