"""The calculator path end to end, against nanochat's own engine on scripted replies.

Two engines run one model: its next token at position ``t`` is ``script[t - len(prompt)]``,
a function of the position alone, so both see the same model whatever they write.

- nanochat's ``Engine.generate`` (reference/nanochat/engine.py, vendored as it is), greedy,
  over a stand-in for its GPT whose logits put the script's token on top, and a tokenizer
  giving it what it calls of ``RustBPETokenizer``, over the test vocabulary;
- lmserve's ``GGUFChatBackend`` as the server builds it (``FAMILY.create_backend``) for a
  tiny nanochat checkpoint of that vocabulary: the plugin opens it, its conventions add the
  ``Calculator``. The model's ``forward`` still writes its rows; its logits are the script's.

The token ids each engine produces must be the same, the calculator's forced
``<|output_start|>result<|output_end|>`` among them, nanochat's masks must mark those as
forced, and the client's text must show them. Where the forced tokens go, the script says
``<|assistant_end|>``: a token that should have been forced and was not ends the reply
there. lmserve runs each case twice: decoding a token a step, and verifying drafts of the
script (the forced tokens then follow an accepted ``<|python_end|>`` draft).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vocab_fixtures as vf
from lmserve_nanochat.plugin import FAMILY, Options
from tiny_nanochat import REFERENCE, Spec, native_config, tiny_model

from lmserve_core.backend import ServerSettings
from lmserve_core.events import Event, Finish, TextDelta
from lmserve_core.gguf_chat import GGUFChatBackend
from lmserve_core.request import Message, NormalizedRequest, Sampling
from lmserve_core.speculative import VerifyCost

torch = pytest.importorskip("torch")
pytest.importorskip("tiktoken")

BOS, USER_START, USER_END = "<|bos|>", "<|user_start|>", "<|user_end|>"
ASSISTANT_START, END = "<|assistant_start|>", "<|assistant_end|>"
PY_START, PY_END = "<|python_start|>", "<|python_end|>"
OUT_START, OUT_END = "<|output_start|>", "<|output_end|>"
QUESTION = "What is 12+30?"
SPEC = Spec("smear", n_layer=2, vocab_size=vf.VOCAB_SIZE)  # the model's vocabulary: the test's
TOP = 10.0  # the script's token's logit (the others 0)


@dataclass(frozen=True)
class Forced:
    """Where the engine writes ``<|output_start|>result<|output_end|>``."""

    result: str


class Vocabulary:
    """The test encoding, and a reply's parts (text, special tokens, forced results) as ids."""

    def __init__(self) -> None:
        self.enc = vf.encoding()

    def special(self, text: str) -> int:
        return self.enc.encode_single_token(text)

    def shown(self, ids: list[int]) -> str:
        """The text a client is sent for ``ids``: the calculator's markers are shown, the
        turn markers (control tokens) are not."""
        hidden = {self.special(t) for t in (BOS, USER_START, USER_END, ASSISTANT_START, END)}
        return self.enc.decode([t for t in ids if t not in hidden])

    def ids(self, parts: list[Any], *, script: bool = False) -> list[int]:
        """The reply's tokens; with ``script``, the model's: ``<|assistant_end|>`` where the
        engine is to force the calculator's answer."""
        out: list[int] = []
        for part in parts:
            if isinstance(part, Forced):
                forced = [self.special(OUT_START), *self.enc.encode_ordinary(part.result),
                          self.special(OUT_END)]
                out += [self.special(END)] * len(forced) if script else forced
            elif part.startswith("<|"):
                out.append(self.special(part))
            else:
                out += self.enc.encode_ordinary(part)
        return out


class Script:
    """The model both engines run: the next token after position ``t`` is
    ``tokens[t + 1 - start]`` (``<|assistant_end|>`` past them)."""

    def __init__(self, vocab: Vocabulary, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.end = vocab.special(END)
        self.start = 0
        self.tokens: list[int] = []

    def next_token(self, pos: int) -> int:
        i = pos + 1 - self.start
        return self.tokens[i] if 0 <= i < len(self.tokens) else self.end

    def logits(self, pos: int, n: int) -> np.ndarray:
        """(n, n_vocab): the rows of the tokens at ``pos .. pos + n - 1``."""
        out = np.zeros((n, self.n_vocab), dtype=np.float32)
        for j in range(n):
            out[j, self.next_token(pos + j)] = TOP
        return out


class EngineTokenizer:
    """What nanochat's Engine calls of its ``RustBPETokenizer`` (nanochat/tokenizer.py),
    as that class does it, over the test encoding."""

    def __init__(self, enc: Any) -> None:
        self.enc = enc

    def encode_special(self, text: str) -> int:
        return self.enc.encode_single_token(text)

    def get_bos_token_id(self) -> int:
        return self.encode_special(BOS)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)


class ScriptedGPT:
    """Stands in for nanochat's GPT in its Engine: the config the KV cache is shaped by, and
    ``forward`` advancing the cache as the model's attention does."""

    def __init__(self, config: Any, script: Script) -> None:
        self.config = config  # NanochatConfig: n_layer, n_head, n_kv_head, n_embd, sequence_len
        self.script = script

    def get_device(self) -> Any:
        return torch.device("cpu")

    def forward(self, idx: Any, targets: Any = None, kv_cache: Any = None) -> Any:
        b, t = idx.shape
        pos = kv_cache.get_pos()
        kv_cache.advance(t)
        return torch.from_numpy(self.script.logits(pos, t)).expand(b, t, -1)


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.cancelled = False

    def emit(self, event: Event) -> None:
        self.events.append(event)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextDelta))


@dataclass
class Served:
    backend: GGUFChatBackend
    vocab: Vocabulary
    script: Script
    Engine: Any  # nanochat.engine.Engine
    accepted: int | None = None  # the drafts the last generation accepted (None: no drafts)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nanochat's base directory: the test tokenizer and a tiny chat model of its vocabulary."""
    root = tmp_path_factory.mktemp("nanochat")
    vf.make_tokenizer(root)
    tm = tiny_model("smear", SPEC)
    model_dir = root / "chatsft_checkpoints" / "d2"
    model_dir.mkdir(parents=True)
    state = {k: torch.from_numpy(v) for k, v in tm.tensors.items()}
    torch.save(state, model_dir / "model_000001.pt")
    meta = {"step": 1, "model_config": native_config(SPEC)}
    (model_dir / "meta_000001.json").write_text(json.dumps(meta))
    return root


class ScriptDrafts:
    """Drafts of the script's own tokens (``<|assistant_end|>`` where the calculator's
    answer goes): the chat path verifies them in passes of several rows, and the forced
    tokens follow an accepted ``<|python_end|>`` draft."""

    name = "script"

    def __init__(self, script: Script) -> None:
        self.script = script

    def drafter(self) -> ScriptDrafts:
        return self

    def propose(self, history: Any, k: int) -> list[int]:
        return [self.script.next_token(len(history) - 1 + j) for j in range(k)]

    def close(self) -> None:
        pass


@pytest.fixture(scope="module", params=[False, True], ids=["decode", "drafts"])
def served(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[Served]:
    """The checkpoint served, its logits the script's; decoding one token a step, or
    verifying the script's drafts."""
    settings = ServerSettings(ctx=256, threads=1, kv_slots=1, batch=1, kv_type="f32",
                              options=Options(load_type="f32"))
    backend = FAMILY.create_backend(str(checkpoint), settings)
    vocab = Vocabulary()
    assert backend.vocab_size == vf.VOCAB_SIZE == vocab.enc.n_vocab
    script = Script(vocab, backend.vocab_size)
    if request.param:
        backend.drafts = ScriptDrafts(script)
        backend.verify_cost = VerifyCost(calibrated=VerifyCost.ROW_MIN)  # verifying pays
    real = backend.model.forward

    def forward(cache: Any, tokens: Any, pos: int, *, all_logits: bool = False) -> np.ndarray:
        real(cache, tokens, pos, all_logits=all_logits)  # the rows are written as ever
        rows = script.logits(pos, len(tokens))
        return rows if all_logits else rows[-1]

    backend.model.forward = forward  # type: ignore[method-assign]
    if str(REFERENCE) not in sys.path:
        sys.path.insert(0, str(REFERENCE))
    from nanochat.engine import Engine

    yield Served(backend, vocab, script, Engine)
    backend.close()


def ask(max_tokens: int = 64, prompt: str | None = None) -> NormalizedRequest:
    messages = [] if prompt is not None else [Message(role="user", content=QUESTION)]
    dialect = "completions" if prompt is not None else "chat"
    return NormalizedRequest(id=f"calc-{max_tokens}", dialect=dialect, messages=messages,
                             prompt=prompt, sampling=Sampling(temperature=0.0),
                             max_tokens=max_tokens)


def run_lmserve(s: Served, request: NormalizedRequest) -> tuple[list[int], list[int], Finish, Sink]:
    """(prompt, generated tokens, finish, sink) of lmserve's generation."""
    sink = Sink()
    s.backend.validate(request)
    gen = s.backend.begin(request, sink)
    while gen.finish is None:
        s.backend.step([gen])
    slot = s.backend.slots.slots[0]
    whole = gen.prepared.tokens + gen.generated
    assert slot.tokens == whole[: len(slot.tokens)]  # the rows written: a prefix of it
    s.accepted = gen.pace.accepted if gen.pace is not None else None
    return gen.prepared.tokens, list(gen.generated), gen.finish, sink


def run_nanochat(s: Served, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """(tokens, masks: 0 where forced) of nanochat's Engine.generate, greedy."""
    model = ScriptedGPT(s.backend.model.config.nanochat, s.script)
    engine = s.Engine(model, EngineTokenizer(s.vocab.enc))
    tokens, masks = [], []
    for column, mask in engine.generate(prompt, max_tokens=max_tokens, temperature=0.0):
        tokens.append(column[0])
        masks.append(mask[0])
    return tokens, masks


def both(s: Served, parts: list[Any], max_tokens: int = 64, prompt: str | None = None) -> tuple[
    list[int], list[int], Finish, Sink
]:
    """Both engines on the script of ``parts``: (lmserve's tokens, nanochat's masks,
    lmserve's finish and sink), the two engines' tokens checked equal."""
    s.script.tokens = s.vocab.ids(parts, script=True)
    request = ask(max_tokens, prompt)
    s.script.start = s.backend.count_tokens(request)
    prompt_ids, got, finish, sink = run_lmserve(s, request)
    assert len(prompt_ids) == s.script.start
    want, masks = run_nanochat(s, prompt_ids, max_tokens)
    assert got == want
    return got, masks, finish, sink


def forced_mask(vocab: Vocabulary, parts: list[Any]) -> list[int]:
    """nanochat's masks of the reply ``parts``: 0 for the forced tokens."""
    return [0 if isinstance(p, Forced) else 1 for p in parts for _ in vocab.ids([p])]


def test_the_prompt_is_nanochats_rendering(served: Served) -> None:
    v = served.vocab
    prompt, *_ = run_lmserve(served, ask(1))
    # tokenizer.render_for_completion of the conversation
    want = [v.special(BOS), v.special(USER_START), *v.enc.encode_ordinary(QUESTION),
            v.special(USER_END), v.special(ASSISTANT_START)]
    assert prompt == want


def test_a_sum_is_answered_as_nanochat_does(served: Served) -> None:
    parts = ["The sum is ", PY_START, "12+30", PY_END, Forced("42"), " so 42.", END]
    got, masks, finish, sink = both(served, parts)
    assert got == served.vocab.ids(parts)
    assert masks == forced_mask(served.vocab, parts)
    assert finish.reason == "stop" and finish.usage.completion_tokens == len(got)
    assert sink.text == (
        "The sum is <|python_start|>12+30<|python_end|><|output_start|>42<|output_end|> so 42."
    )
    assert served.accepted is None or served.accepted > 0


REPLIES = {
    "count": ["There are ", PY_START, "'strawberry'.count('r')", PY_END, Forced("3"), " r.", END],
    "commas and division": [PY_START, "1,000 * 7/2", PY_END, Forced("3500.0"), END],
    "a float": [PY_START, "0.1+0.2", PY_END, Forced("0.30000000000000004"), END],
    "an exponent": [PY_START, "0.1*1000000000000000000000", PY_END, Forced("1e+20"), END],
    "a negative": [PY_START, "10 - 15", PY_END, Forced("-5"), END],
    "a tuple": [PY_START, "()", PY_END, Forced("()"), END],
    "two calls": [PY_START, "6*7", PY_END, Forced("42"), " and ", PY_START, "7//2", PY_END,
                  Forced("3"), ".", END],
    "the same call twice": [PY_START, "6*7", PY_END, Forced("42"), ", again ", PY_START, "6*7",
                            PY_END, Forced("42"), END],
    "a second start restarts": [PY_START, "1+", PY_START, "2+3", PY_END, Forced("5"), END],
    "the power operator": ["So ", PY_START, "2**10", PY_END, " is 1024.", END],
    "an import": [PY_START, "import os", PY_END, " no.", END],
    "a name": [PY_START, "len('abc')", PY_END, END],
    "division by zero": [PY_START, "1/0", PY_END, "!", END],
    "an empty expression": [PY_START, PY_END, " none", END],
    "a control token inside": [PY_START, "1+", USER_END, "1", PY_END, " x", END],
    "an end without a start": ["12+30", PY_END, " 42", END],
    "a second end": [PY_START, "2+2", PY_END, Forced("4"), PY_END, " ok", END],
    "the end at <|bos|>": [PY_START, "2+2", PY_END, Forced("4"), BOS],
}


@pytest.mark.parametrize("name", REPLIES)
def test_replies_as_nanochat(served: Served, name: str) -> None:
    parts = REPLIES[name]
    got, masks, finish, sink = both(served, parts)
    assert got == served.vocab.ids(parts)
    assert masks == forced_mask(served.vocab, parts)
    assert finish.reason == "stop"
    assert sink.text == served.vocab.shown(got)


def test_a_block_opened_in_the_prompt_is_not_answered(served: Served) -> None:
    # nanochat's engine reads only the tokens it generates for a block; so does lmserve
    prompt = f"{USER_START}{QUESTION}{USER_END}{ASSISTANT_START}The sum is {PY_START}12+30"
    parts = [PY_END, " so 42.", END]
    got, _, finish, _ = both(served, parts, prompt=prompt)
    assert got == served.vocab.ids(parts) and finish.reason == "stop"


def test_the_budget_cuts_the_forced_tokens_as_nanochats(served: Served) -> None:
    v = served.vocab
    parts = ["It is ", PY_START, "12345*6789", PY_END, Forced("83810205"), " in all.", END]
    whole = v.ids(parts)
    closed = whole.index(v.special(PY_END)) + 1
    forced = len(v.ids([Forced("83810205")]))
    assert forced >= 4  # the result is several tokens: some budgets cut inside it
    for budget in range(closed - 1, closed + forced + 2):
        got, masks, finish, sink = both(served, parts, max_tokens=budget)
        assert got == whole[:budget], budget
        assert masks == forced_mask(v, parts)[:budget], budget
        assert finish.reason == "length" and finish.usage.completion_tokens == budget
        assert sink.text == v.shown(got)
