"""The Backend contract: what a model family provides to the server.

A backend is an object with two methods that matter to the server:

* ``validate(request)`` runs on the request's connection path before it is queued. It is
  cheap: message shape, capabilities, prompt length. It raises an ``LmserveError``.
* ``generate(request, sink)`` runs on the single inference worker thread. It emits
  events into ``sink`` (text, reasoning, tool calls) and returns a ``Finish`` event.
  It checks ``sink.cancelled`` between tokens and stops early when it turns true. The
  engine applies the request's ``stop`` strings and ``max_tokens`` to what it emits and
  counts the usage a ``Finish`` leaves out, whatever the backend does itself (see
  ``lmserve_core.contract``); what it emits are the events of ``lmserve_core.events``.

The contract's optional members come in groups, each a runtime-checkable Protocol below
(``Batching``, ``CountsTokens``, ``HasVocabulary``, ``HasSlots``, ``Speculates``,
``ServesPrefixes``, ``HasModel``, ``HasFamily``): a backend has a capability when it has
every member its Protocol names, and core asks ``isinstance(backend, Batching)``, never
for one attribute at a time. A batching backend generates several requests together: the
worker keeps up to ``batch_size`` generations running, takes new requests in between
steps and lets ended ones leave; ``generate`` still serves requests alone.

Families that fit the generic GGUF chat path do not write these themselves: see
``lmserve_core.gguf_chat``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .events import EventSink, Finish
from .request import NormalizedRequest

# re-exported: families import them from here
from .settings import AUTO_SLOTS as AUTO_SLOTS
from .settings import ServerSettings as ServerSettings

if TYPE_CHECKING:
    from .cartridge.route import FleetRouter
    from .cartridge.serve import PrefixRows
    from .gguf_file import GGUFFile
    from .kv_slots import SlotPool
    from .speculative import DraftSource
    from .tokenizer import Tokenizer
    from .tools import ToolConvention


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can honor; the dialects reject requests asking for more."""

    grammar: bool = False  # constrained decoding (response_format, regex, lark, forced tools)
    reasoning: bool = False  # a reasoning channel that can be switched on
    # How the family's model writes calls (lmserve_core.tools.HERMES, ...); None: it has no
    # convention, and only forced calls (through a grammar) can produce one.
    tools: ToolConvention | None = None
    stop_strings: bool = True  # text stop sequences (core applies them; False refuses them)
    system_role: bool = True  # accepts system messages
    raw_completion: bool = True  # /v1/completions (raw prompt, no chat template)
    # /v1/completions prompts given as token ids (NormalizedRequest.prompt_ids), read
    # verbatim; a backend that takes them also checks the ids against its vocabulary
    token_prompts: bool = False
    # token-id logit biases (OpenAI's logit_bias); a backend that honours them also checks
    # the ids against its vocabulary in validate
    logit_bias: bool = False
    # Why this model takes no tools and no output constraints at all, when it cannot (it
    # does not write token by token): requests declaring tools or asking for a constraint
    # are then a 400 naming the field, not a 501 or tools dropped. None: the rules above.
    refuses_tools: str | None = None

    @property
    def tool_style(self) -> str:
        """The tool convention's name, or "none"."""
        return self.tools.name if self.tools is not None else "none"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The family's recommended sampling, used where a request leaves a field out."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    open: str = "<think>"
    close: str = "</think>"


@runtime_checkable
class Backend(Protocol):
    """The object a backend factory returns."""

    name: str  # backend name, e.g. "llama"
    model_id: str  # what /v1/models reports
    capabilities: Capabilities
    context_length: int  # tokens of context this instance serves (<= --ctx)

    def validate(self, request: NormalizedRequest) -> None:
        """Raise an LmserveError if the request cannot be served; cheap, any thread."""

    def generate(self, request: NormalizedRequest, sink: EventSink) -> Finish:
        """Generate the reply on the worker thread, emitting events into ``sink``."""

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (``/tokenize``)."""

    def detokenize(self, ids: list[int]) -> str:
        """Text of ``ids`` (``/detokenize``)."""

    def token_piece(self, token_id: int) -> bytes:
        """The raw bytes of one token (``/tokenize`` with_pieces)."""

    def close(self) -> None:
        """Release the model; called once at shutdown."""


# ---------------------------------------------------------------- optional members
#
# A backend has one of these capabilities when it has every member the Protocol names
# (``isinstance`` checks that they are present, not their types). A member whose value may
# be None (``prefix`` without a cartridge, ``drafts`` without speculation) still counts as
# present; callers read the value after the ``isinstance``.


class BatchedGeneration(Protocol):
    """The handle ``Batching.begin`` returns for one request."""

    finish: Finish | None  # None while it runs; set by ``step`` (or ``begin``) when it ends


@runtime_checkable
class Batching(Protocol):
    """Generates several requests together, a token (or a prompt chunk) per ``step``."""

    batch_size: int  # how many generations it runs at once

    def begin(self, request: NormalizedRequest, sink: EventSink) -> BatchedGeneration:
        """Start generating ``request`` into ``sink`` on the worker thread; the handle's
        ``finish`` is already set when it ends at once (a failed validation, say)."""

    def step(self, generations: Sequence[Any]) -> None:
        """Advance each unfinished generation by a token, setting ``finish`` on those
        that end."""


@runtime_checkable
class CountsTokens(Protocol):
    """Counts a prompt's tokens exactly (``/v1/messages/count_tokens``, usage a ``Finish``
    leaves out); without it core estimates from ``tokenize``."""

    def count_tokens(self, request: NormalizedRequest) -> int:
        """The prompt's token count as it will be fed (chat template included)."""


@runtime_checkable
class HasVocabulary(Protocol):
    """Knows its vocabulary's size: token ids a client sends (``/detokenize``, token-id
    prompts) are checked against it with a 400 naming the field."""

    vocab_size: int


@runtime_checkable
class HasSlots(Protocol):
    """Keeps KV caches in a pool of slots (``/metrics`` counts them; the start-up banner
    shows how many and the bytes they take at full context)."""

    slots: SlotPool[Any]
    kv_slots: int
    kv_bytes: int | None  # None: the model does not say


@runtime_checkable
class Speculates(Protocol):
    """Can decode speculatively (``--spec``, ``--spec-draft``)."""

    drafts: DraftSource | None  # where drafts come from; None: decoding plainly


@runtime_checkable
class ServesPrefixes(Protocol):
    """Can serve conversations behind KV prefix rows (``--cartridge``, ``--fleet``)."""

    prefix: PrefixRows | None  # the cartridge every conversation starts behind
    fleet: FleetRouter | None  # the fleet of documents conversations are routed to


@runtime_checkable
class HasModel(Protocol):
    """Serves a GGUF model core can read (``lmserve cartridge`` reads its rows; the banner
    shows its file, architecture and KV type)."""

    model: Any  # its ForwardModel (lmserve_core.model)
    tokenizer: Tokenizer
    gguf: GGUFFile


@runtime_checkable
class HasFamily(Protocol):
    """Names the family it belongs to (``/v1/models`` ``meta.family``; without it, its
    ``name``)."""

    family: str


BackendFactory = Callable[[str | None, ServerSettings], Backend]


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend as registered by a plugin."""

    name: str
    factory: BackendFactory
    architectures: tuple[str, ...] = ()  # GGUF general.architecture values it serves
    description: str = ""
    default_model: Callable[[], str | None] | None = None  # model served when none is given
    plugin: str = ""  # the plugin that registered it
    # True for a model path it serves that is not a GGUF file (e.g. a checkpoint directory)
    recognizes: Callable[[str], bool] | None = None
    # its own options (``ServerSettings.options``) from the parsed flags its plugin added
    # through ``register_options``
    options: Callable[[Any], object] | None = None
    # a flag of its own that names its model and picks it (``--nanochat DIR``)
    model_option: str | None = None
