"""Self-study: conversations about spans of the corpus, generated on lmserve's own engine
(see :mod:`.train`)."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .distill import TOP_K, Conversation, teacher_targets
from .file import Cartridge
from .torch_lm import TorchLM

CONTEXT_PROMPT = (
    "Please reference the following information when answering the user's questions.\n\n{chunk}"
)
# Seed prompts for bot A: the form of its message, never its content (the chunk is the sole
# content selector, which keeps every message answerable from what the teacher sees).
SEED_PROMPTS = (
    "Write one question about a specific detail in the text above: a name, a number, a "
    "place or a date. Write only the question.",
    "Write one question that asks what the text above says about one of the things it "
    "names. Write only the question.",
)
# Messages sent as they are, without bot A: a small model writes poor requests of this kind,
# and these distil the chunk's content as a whole.
DIRECT_PROMPTS = (
    "Summarize the text above, keeping every name and number.",
    "List the facts in the text above.",
    "What does the text above say? Repeat its details exactly.",
)
ASK_TRIES = 2  # bot A's attempts at a message that is a question before a direct prompt


@dataclass
class TrainConfig:
    """What ``lmserve cartridge build --train`` takes."""

    p: int = 128
    steps: int = 200
    lr: float = 2e-3
    accum: int = 4  # conversations per optimizer step
    conversations: int = 0  # self-study conversations to generate (0: steps * accum / 2)
    holdout: int = 8  # of those, kept out of training for the held-out loss
    chunk_min: int = 64
    chunk_max: int = 256
    max_q: int = 48
    max_a: int = 128
    temperature: float = 0.6  # bot A's
    top_k: int = TOP_K
    seed: int = 0
    save_every: int = 25
    threads: int = 0

    def n_conversations(self) -> int:
        want = self.conversations or max(8, self.steps * self.accum // 2)
        return want + self.holdout


@dataclass
class Model:
    """The GGUF loaded twice: lmserve's engine (generation, tokenizer, chat template) and a
    torch copy (gradients)."""

    path: Path
    backend: Any
    lm: TorchLM
    last_stop: int | None = None  # the end-of-generation token that ended the last sample

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, threads: int = 0, ctx: int = 4096) -> Model:
        """Load ``path``; ``threads`` > 0 sets both the engine's and torch's threads (on a
        busy machine one thread each beats the contention of more)."""
        from lmserve_core.backend import ServerSettings
        from lmserve_core.gguf_file import GGUFFile
        from lmserve_core.plugins import backend_for_architecture

        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        path = Path(path)
        with GGUFFile.open(str(path)) as g:
            arch = g.architecture
        spec = backend_for_architecture(arch)
        if spec is None:
            raise ValueError(f"{path}: no installed lmserve family serves architecture {arch!r}")
        backend = spec.factory(str(path), ServerSettings(ctx=ctx, threads=threads, kv_slots=1))
        return cls.from_backend(backend)

    @classmethod
    def from_backend(cls, backend: Any) -> Model:
        """The torch copy of a chat backend's GGUF beside the backend itself."""
        path = Path(backend.gguf.path)
        return cls(path, backend, TorchLM.from_gguf(path, str(backend.gguf.architecture)))

    @property
    def architecture(self) -> str:
        return str(self.backend.gguf.architecture)

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def stop(self) -> frozenset[int]:
        return frozenset(self.backend.tokenizer.eog_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def prompt(self, messages: list[dict[str, str]], *, generation: bool = True) -> list[int]:
        """Token ids of a chat as the server renders and encodes it."""
        text = self.backend.template.render(messages, add_generation_prompt=generation)
        return list(self.tokenizer.encode(text, add_special=True, parse_special=True))

    def sample(
        self,
        ids: Sequence[int],
        max_new: int,
        temperature: float,
        rng: random.Random,
        *,
        engine: Any = None,
    ) -> list[int]:
        """Tokens after ``ids`` from lmserve's engine: greedy at temperature 0, else sampled
        (the end-of-generation token that stopped it, if any, in :attr:`last_stop`);
        ``engine``: another forward model to run (a prefixed one, serving a cartridge)."""
        engine = self.backend.model if engine is None else engine
        self.last_stop = None
        cache = engine.new_cache(len(ids) + max_new + 1)
        try:
            logits = engine.forward(cache, list(ids), 0)
            out: list[int] = []
            for i in range(max_new):
                if temperature <= 0:
                    tok = int(np.argmax(logits))
                else:
                    z = logits.astype(np.float64) / temperature
                    z = np.exp(z - z.max())
                    tok = int(np.searchsorted(np.cumsum(z), rng.random() * z.sum()))
                    tok = min(tok, z.size - 1)
                if tok in self.stop:
                    self.last_stop = tok
                    break
                out.append(tok)
                logits = engine.forward(cache, [tok], len(ids) + i)
            return out
        finally:
            close = getattr(cache, "close", None)
            if close is not None:
                close()

    def metadata(self, p: int, init: str) -> dict[str, str]:
        return {
            "architecture": self.architecture,
            "model": self.path.name,
            "model_id": str(self.backend.model_id),
            "init": init,
            "p": str(p),
        }

    def close(self) -> None:
        self.backend.close()


def prefill_ids(model: Model, corpus: str, p: int) -> list[int]:
    """The tokens a prefill cartridge holds: the document's first ``p``, as ``lmserve
    cartridge build --init prefill`` reads it (BOS first when the vocabulary adds one)."""
    from .prefill import document_tokens

    return document_tokens(model.tokenizer, corpus)[:p]


def prefill_cartridge(model: Model, corpus: str, p: int) -> Cartridge:
    """The prefill cartridge of ``corpus``'s first ``p`` tokens, its rows read from
    lmserve's own cache (exactly what serving the document as a prompt leaves there)."""
    from .prefill import capture_rows

    ids = prefill_ids(model, corpus, p)
    if len(ids) < 2:
        raise ValueError(f"the document has {len(ids)} tokens: a cartridge needs 2")
    k, v = capture_rows(model.backend.model, ids)
    return Cartridge(
        k=k,
        v=v,
        metadata=model.metadata(len(ids), "prefill"),
        draft_reference=np.asarray(ids, np.int64),
    )


def self_study(
    model: Model, corpus_ids: Sequence[int], cfg: TrainConfig, index: int
) -> Conversation:
    """Conversation ``index`` of the self-study set (its randomness a function of the seed
    and the index alone, so a resumed run regenerates nothing it has)."""
    rng = random.Random(f"{cfg.seed}:conversation:{index}")
    n = len(corpus_ids)
    length = rng.randint(min(cfg.chunk_min, n), min(cfg.chunk_max, n))
    start = rng.randint(0, n - length)
    chunk = model.decode(corpus_ids[start : start + length]).strip()
    system = {"role": "system", "content": CONTEXT_PROMPT.format(chunk=chunk)}
    seed = rng.randrange(len(SEED_PROMPTS) + len(DIRECT_PROMPTS))
    question = ""
    if seed < len(SEED_PROMPTS):
        for _ in range(ASK_TRIES):
            asked = model.sample(
                model.prompt([system, {"role": "user", "content": SEED_PROMPTS[seed]}]),
                cfg.max_q,
                cfg.temperature,
                rng,
            )
            text = model.decode(asked).strip()
            if text.endswith("?") and model.last_stop is not None:
                question = text
                break
    if not question:
        seed = len(SEED_PROMPTS) + rng.randrange(len(DIRECT_PROMPTS))
        question = DIRECT_PROMPTS[seed - len(SEED_PROMPTS)]
    user = {"role": "user", "content": question}
    teacher_prompt = model.prompt([system, user])
    answer_ids = model.sample(teacher_prompt, cfg.max_a, 0.0, rng)
    # the end-of-turn token the model closed its answer with is supervised too
    supervised = answer_ids + ([model.last_stop] if model.last_stop is not None else [])
    teacher = teacher_prompt + supervised
    with model.lm.torch.no_grad():
        logits = model.lm.logits(teacher)
    top_ids, top_lp = teacher_targets(logits, len(teacher_prompt), len(supervised), cfg.top_k)
    student_prompt = model.prompt([user])
    return Conversation(
        student=student_prompt + supervised,
        start=len(student_prompt),
        top_ids=top_ids,
        top_logprobs=top_lp,
        question=question,
        answer=model.decode(answer_ids),
        seed=seed,
    )
