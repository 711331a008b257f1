"""A scripted stand-in for a family's forward pass over the real SmolLM2 tokenizer and
template, and helpers to drive :class:`~lmserve_core.gguf_chat.GGUFChatBackend` with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from models import smollm2_path

from lmserve_core import gguf_chat
from lmserve_core.backend import Capabilities, SamplingDefaults, ServerSettings
from lmserve_core.events import ErrorEvent, Event, Finish, ReasoningDelta, TextDelta
from lmserve_core.gguf_chat import GGUFChatBackend
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.model import AttentionCache, FamilyConventions
from lmserve_core.request import Message, NormalizedRequest, Sampling
from lmserve_core.tokenizer import Tokenizer

GREEDY = Sampling(temperature=0.0)
# A small JSON schema whose keys and punctuation a grammar forces.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "email": {"type": "string"}},
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
IM_START, IM_END = 1, 2  # SmolLM2's ChatML control tokens


class FakeCache(AttentionCache):
    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.rows = np.full(n_ctx, -1, dtype=np.int64)  # the token each K/V row was made from

    def snapshot(self, n: int) -> np.ndarray:
        return self.rows[:n].astype("<i8").view(np.uint8).copy()

    def restore(self, n: int, state: np.ndarray) -> None:
        rows = np.asarray(state, dtype=np.uint8).view("<i8")
        if rows.size != n:
            raise ValueError("a state of another length")
        self.rows[:n] = rows


class ScriptedModel:
    """Replies with ``script`` (token ids), counted from the last ``<|im_start|>assistant\\n``;
    past the script, pseudo-random logits that depend only on the position."""

    n_ctx_train = 8192

    def __init__(self, n_vocab: int, script: Sequence[int] = ()) -> None:
        self.n_vocab = n_vocab
        self.script = list(script)
        self.forward_calls: list[tuple[int, int]] = []  # (pos, n_tokens)
        self.copies: list[int] = []

    def new_cache(self, n_ctx: int) -> FakeCache:
        return FakeCache(n_ctx)

    def forward(
        self, cache: FakeCache, tokens: Sequence[int], pos: int, *, all_logits: bool = False
    ) -> np.ndarray:
        assert len(tokens) > 0 and pos + len(tokens) <= cache.n_ctx
        # every row below pos must hold a prefix computed earlier (reuse/copy correctness)
        assert (cache.rows[:pos] >= 0).all(), "forward over a hole in the cache"
        cache.rows[pos : pos + len(tokens)] = tokens
        self.forward_calls.append((pos, len(tokens)))
        end = pos + len(tokens)
        if all_logits:
            return np.stack([self.logits(cache.rows[: end - i]) for i in range(len(tokens))][::-1])
        return self.logits(cache.rows[:end])

    def logits(self, seq: np.ndarray) -> np.ndarray:
        """The logits after the tokens ``seq``."""
        starts = np.flatnonzero(seq == IM_START)
        i = len(seq) - (int(starts[-1]) + 4) if starts.size else len(seq)
        if 0 <= i < len(self.script):
            logits = np.zeros(self.n_vocab, dtype=np.float32)
            logits[self.script[i]] = 10.0
            return logits
        return np.random.default_rng(len(seq)).standard_normal(self.n_vocab).astype(np.float32)

    def copy_rows(self, src: FakeCache, dst: FakeCache, n: int) -> None:
        self.copies.append(n)
        dst.rows[:n] = src.rows[:n]


class ListSink:
    def __init__(self, cancel_after: int | None = None) -> None:
        self.events: list[Event] = []
        self.cancel_after = cancel_after

    def emit(self, event: Event) -> None:
        self.events.append(event)

    @property
    def cancelled(self) -> bool:
        n = sum(isinstance(e, TextDelta) for e in self.events)
        return self.cancel_after is not None and n >= self.cancel_after

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextDelta))

    @property
    def reasoning(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, ReasoningDelta))


# Fixtures for the modules that import them (``_gguf``, ``_tokenizer``, ``_one_tokenizer``): the
# SmolLM2 file as ``gguf``, its tokenizer, and one tokenizer shared by every fake backend.


@pytest.fixture(scope="module", name="gguf")
def _gguf() -> GGUFFile:
    return GGUFFile.open(smollm2_path())


@pytest.fixture(scope="module", name="tokenizer")
def _tokenizer(gguf: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(gguf)


@pytest.fixture(autouse=True)
def _one_tokenizer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Building the vocabulary takes a moment; every fake backend can share one.
    if "gguf" in request.fixturenames:
        shared = request.getfixturevalue("tokenizer")
        monkeypatch.setattr(gguf_chat.Tokenizer, "from_gguf", classmethod(lambda cls, g: shared))


def make_backend(
    gguf: GGUFFile,
    script: Sequence[int] = (),
    *,
    ctx: int = 2048,
    slots: int = 1,
    batch: int = 1,
    model: ScriptedModel | None = None,
    **conv: Any,
) -> GGUFChatBackend:
    conv.setdefault("capabilities", Capabilities(grammar=True))
    conventions = FamilyConventions(sampling=SamplingDefaults(), **conv)
    return GGUFChatBackend(
        name="fake",
        gguf=gguf,
        model=model or ScriptedModel(49152, script),  # type: ignore[arg-type]
        conventions=conventions,
        settings=ServerSettings(ctx=ctx, kv_slots=slots, batch=batch),
    )


def ids(backend: GGUFChatBackend, text: str) -> list[int]:
    return backend.tokenize(text, parse_special=True)


def chat(*turns: str, **kw: Any) -> NormalizedRequest:
    roles = ["user", "assistant"]
    messages = [Message(role=roles[i % 2], content=t) for i, t in enumerate(turns)]  # type: ignore[arg-type]
    kw.setdefault("sampling", GREEDY)
    return NormalizedRequest(
        id=f"req-{len(turns)}-{id(kw)}", dialect="chat", messages=messages, **kw
    )


def run(backend: GGUFChatBackend, request: NormalizedRequest, sink: ListSink | None = None):  # type: ignore[no-untyped-def]
    sink = sink or ListSink()
    backend.validate(request)
    finish = backend.generate(request, sink)
    assert isinstance(finish, Finish)
    assert not any(isinstance(e, (Finish, ErrorEvent)) for e in sink.events), sink.events
    return finish, sink


def check_shadow(backend: GGUFChatBackend) -> None:
    for slot in backend.slots.slots:
        if slot.allocated:
            rows = slot.cache.rows[: len(slot.tokens)]  # type: ignore[attr-defined]
            assert rows.tolist() == slot.tokens


