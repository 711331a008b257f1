"""Training a cartridge by self-study ("Cartridges", arXiv 2506.06266), with torch.

The cartridge is a KV prefix of ``p`` rows per layer: keys after the k-norm and after RoPE at
positions ``0..p-1``, values as the cache holds them. It starts as the model's own prefill of
the first ``p`` tokens of the corpus (rendered as a system message), row 0 (the attention
sink) stays frozen, and rows ``1..p-1`` are trained by context distillation:

1. Self-study. A random span of the corpus is put in the system message; the model writes a
   message about it (bot A, sampled, from one of a few seed prompts that give the *form* of
   the message, never its content) and answers that message with the span in context (bot B,
   greedy). Generation runs on lmserve's own engine in-process (the native kernels are many
   times faster than a torch decode on a CPU); the teacher's top-k next-token distribution
   over the answer comes from one teacher-forced torch pass over the same weights the
   student runs on.
2. Distillation. The student is the same model *without* the span, behind the cartridge, on
   the user message alone (the prompt a server would see); the loss is the teacher's top-k
   cross-entropy ``-sum p_teacher log q_student`` over the answer tokens (top 20 entries,
   truncated at 0.99 of the mass, not renormalised), Adam on the rows.

Gradients run through a torch copy of the model: transformers' GGUF loader dequantises the
file's weights (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``) and the
prefix goes in as ``past_key_values``, so the question's positions start at ``p``. The
loader un-permutes llama's q/k weights for transformers' half-split rotation; the cartridge
file holds keys the way lmserve's cache holds them (adjacent-pair rotation over the file's
permuted weights), so llama keys are re-permuted on the way out and back (:func:`key_order`).

Torch is an optional extra (``pip install lmserve-core[train]``); nothing at serving time
imports this module.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .file import Cartridge, write_cartridge

# transformers' GGUF loader reverse-permutes attn_q / attn_k of these architectures (its
# half-split rotation against llama.cpp's adjacent pairs); their cartridge keys are permuted
# back to the file's order.
PERMUTED_ARCHITECTURES = frozenset({"llama"})

CONTEXT_PROMPT = (
    "Please reference the following information when answering the user's questions.\n\n"
    "{chunk}"
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
TOP_K = 20
TOP_MASS = 0.99


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


def key_order(head_dim: int) -> np.ndarray:
    """Index map from transformers' half-split key order to the file's adjacent-pair order:
    ``file = hf[..., key_order(d)]`` (pair i of the file is (i, i + d/2) of transformers)."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


# --------------------------------------------------------------------------- torch model


class TorchLM:
    """A frozen transformers causal LM and the cartridge plumbing around it: prefill K/V,
    logits behind a prefix, greedy decode behind a prefix, last hidden state."""

    def __init__(self, hf: Any, *, permuted: bool) -> None:
        import torch

        self.torch = torch
        self.hf = hf.eval()
        for w in self.hf.parameters():
            w.requires_grad_(False)
        cfg = hf.config.get_text_config(decoder=True)
        self.config = cfg
        self.n_layer = int(cfg.num_hidden_layers)
        self.n_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.permuted = permuted
        # the cache argument's name: `cache` in recent transformers, `past_key_values` before
        params = inspect.signature(type(self.hf).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        order = key_order(self.head_dim)
        self._to_file = torch.as_tensor(order)
        self._from_file = torch.as_tensor(np.argsort(order))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], architecture: str) -> TorchLM:
        """The GGUF's weights dequantised to float32 by transformers' GGUF loader."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        path = Path(path)
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
        return cls(hf, permuted=architecture in PERMUTED_ARCHITECTURES)

    def _cache(self, prefix: tuple[Any, Any] | None, *, batched: bool = False) -> Any:
        """A transformers cache holding ``prefix`` (``[n_layer, (batch,) n_kv_heads, p,
        head_dim]``)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config)
        if prefix is not None:
            k, v = prefix
            for i in range(self.n_layer):
                ki, vi = (k[i], v[i]) if batched else (k[i].unsqueeze(0), v[i].unsqueeze(0))
                cache.update(ki, vi, i)
        return cache

    def prefill(self, ids: Sequence[int]) -> tuple[Any, Any]:
        """K and V of ``ids`` at positions 0.., as ``[n_layer, n_kv_heads, n, head_dim]``
        in transformers' key order."""
        torch = self.torch
        with torch.no_grad():
            cache = self._cache(None)
            self.hf(input_ids=torch.tensor([list(ids)]), use_cache=True, **{self._cache_arg: cache})
            k = torch.stack([cache.layers[i].keys[0] for i in range(self.n_layer)])
            v = torch.stack([cache.layers[i].values[0] for i in range(self.n_layer)])
        return k.contiguous(), v.contiguous()

    def logits(self, ids: Sequence[int], prefix: tuple[Any, Any] | None = None) -> Any:
        """Logits ``[len(ids), vocab]`` of ``ids`` behind ``prefix`` (positions start at its
        length); differentiable in the prefix."""
        torch = self.torch
        out = self.hf(
            input_ids=torch.tensor([list(ids)]), use_cache=True,
            **{self._cache_arg: self._cache(prefix)},
        )
        return out.logits[0]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prefix: tuple[Any, Any] | None,
        max_new: int,
        stop: frozenset[int] | set[int],
    ) -> list[list[int]]:
        """Greedy tokens after each of ``prompts`` behind ``prefix`` (stop token excluded),
        the prompts decoded together (left-padded; positions and mask per row)."""
        torch = self.torch
        n = len(prompts)
        if n == 0:
            return []
        width = max(len(q) for q in prompts)
        p = 0 if prefix is None else int(prefix[0].shape[2])
        ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, p + width), dtype=torch.long)
        mask[:, :p] = 1
        for r, q in enumerate(prompts):
            ids[r, width - len(q) :] = torch.tensor(list(q))
            mask[r, p + width - len(q) :] = 1
        pos = (mask[:, p:].cumsum(-1) - 1).clamp(min=0) + p
        batch_prefix = None
        if prefix is not None:
            k, v = prefix
            batch_prefix = (k.unsqueeze(1).expand(-1, n, -1, -1, -1), v.unsqueeze(1).expand(-1, n, -1, -1, -1))
        out: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        with torch.no_grad():
            cache = self._cache(batch_prefix, batched=True)
            for _ in range(max_new):
                logits = self.hf(
                    input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **{self._cache_arg: cache},
                ).logits[:, -1]
                nxt = logits.argmax(-1)
                for r in range(n):
                    tok = int(nxt[r])
                    if done[r] or tok in stop:
                        done[r] = True
                    else:
                        out[r].append(tok)
                if all(done):
                    break
                ids = nxt.unsqueeze(1)
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
                pos = pos[:, -1:] + 1
        return out

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The final-norm hidden state of the last of ``ids`` (float32)."""
        torch = self.torch
        with torch.no_grad():
            base = self.hf.get_decoder() if hasattr(self.hf, "get_decoder") else self.hf.model
            h = base(input_ids=torch.tensor([list(ids)])).last_hidden_state[0, -1]
        return h.float().numpy().copy()

    # the file's layout: per layer [p, n_kv_heads, head_dim], keys in the file's order
    def to_cartridge(self, k: Any, v: Any, metadata: dict[str, str]) -> Cartridge:
        torch = self.torch
        with torch.no_grad():
            kk = k.detach()
            if self.permuted:
                kk = kk.index_select(-1, self._to_file)
            ks = [kk[i].transpose(0, 1).contiguous().numpy().astype(np.float32) for i in range(self.n_layer)]
            vs = [v.detach()[i].transpose(0, 1).contiguous().numpy().astype(np.float32) for i in range(self.n_layer)]
        return Cartridge(k=ks, v=vs, metadata=dict(metadata), frozen_prefix=1)

    def from_cartridge(self, cart: Cartridge) -> tuple[Any, Any]:
        torch = self.torch
        k = torch.stack([torch.from_numpy(np.asarray(a, np.float32)).transpose(0, 1) for a in cart.k])
        v = torch.stack([torch.from_numpy(np.asarray(a, np.float32)).transpose(0, 1) for a in cart.v])
        if self.permuted:
            k = k.index_select(-1, self._from_file)
        return k.contiguous(), v.contiguous()


class Prefix:
    """The trainable prefix: a frozen sink row and ``p - 1`` leaf rows per layer (K and V,
    ``[n_layer, n_kv_heads, rows, head_dim]``)."""

    def __init__(self, k: Any, v: Any) -> None:
        self.sink_k = k[:, :, :1].detach().clone()
        self.sink_v = v[:, :, :1].detach().clone()
        self.k = k[:, :, 1:].detach().clone().requires_grad_(True)
        self.v = v[:, :, 1:].detach().clone().requires_grad_(True)

    @property
    def p(self) -> int:
        return int(self.k.shape[2]) + 1

    def full(self) -> tuple[Any, Any]:
        import torch

        return torch.cat([self.sink_k, self.k], dim=2), torch.cat([self.sink_v, self.v], dim=2)

    def params(self) -> list[Any]:
        return [self.k, self.v]


# --------------------------------------------------------------------------- distillation


@dataclass
class Conversation:
    """One self-study example: the student's tokens (chat prompt without the chunk, then the
    answer), where the answer starts, and the teacher's top-k over each answer token."""

    student: list[int]
    start: int
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    question: str = ""
    answer: str = ""
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Conversation:
        return cls(**json.loads(line))


def teacher_targets(logits: Any, start: int, n: int, k: int = TOP_K) -> tuple[list[list[int]], list[list[float]]]:
    """Top-``k`` log-probabilities predicting the ``n`` tokens from ``start`` (rows
    ``start-1 ..``), each truncated once 0.99 of the mass is covered."""
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(logits[start - 1 : start - 1 + n].float(), dim=-1)
        vals, idx = lp.topk(k, dim=-1)
    ids_out, lp_out = [], []
    for row_v, row_i in zip(vals.tolist(), idx.tolist(), strict=True):
        mass, keep = 0.0, 0
        for x in row_v:
            keep += 1
            mass += math.exp(x)
            if mass >= TOP_MASS:
                break
        ids_out.append(row_i[:keep])
        lp_out.append(row_v[:keep])
    return ids_out, lp_out


def distill_loss(lm: TorchLM, prefix: tuple[Any, Any] | None, conv: Conversation) -> Any:
    """Teacher top-k cross-entropy of the student behind ``prefix``, mean over the answer."""
    torch = lm.torch
    logits = lm.logits(conv.student, prefix)
    n = len(conv.top_ids)
    lp = torch.log_softmax(logits[conv.start - 1 : conv.start - 1 + n], dim=-1)
    width = max(len(r) for r in conv.top_ids)
    ids = torch.zeros((n, width), dtype=torch.long)
    weight = torch.zeros((n, width))
    for r, (ri, rl) in enumerate(zip(conv.top_ids, conv.top_logprobs, strict=True)):
        ids[r, : len(ri)] = torch.tensor(ri)
        weight[r, : len(rl)] = torch.tensor(rl).exp()
    return -(weight * lp.gather(1, ids)).sum(-1).mean()


class Trainer:
    """Adam on the prefix rows over self-study conversations, with resumable state."""

    def __init__(self, lm: TorchLM, prefix: Prefix, lr: float) -> None:
        import torch

        self.lm, self.prefix = lm, prefix
        self.opt = torch.optim.Adam(prefix.params(), lr=lr)
        self.step_no = 0
        self.losses: list[float] = []

    def step(self, batch: Sequence[Conversation]) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for conv in batch:
            loss = distill_loss(self.lm, self.prefix.full(), conv) / len(batch)
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.step_no += 1
        self.losses.append(total)
        return total

    def held_out(self, convs: Sequence[Conversation], prefix: tuple[Any, Any] | None = None) -> float:
        """Mean distillation loss over ``convs`` (behind the trained prefix by default)."""
        torch = self.lm.torch
        if not convs:
            return float("nan")
        with torch.no_grad():
            use = self.prefix.full() if prefix is None else prefix
            return sum(float(distill_loss(self.lm, use, c)) for c in convs) / len(convs)

    def save(self, path: Path) -> None:
        torch = self.lm.torch
        state = {
            "k": self.prefix.k.detach(), "v": self.prefix.v.detach(),
            "sink_k": self.prefix.sink_k, "sink_v": self.prefix.sink_v,
            "opt": self.opt.state_dict(), "step": self.step_no, "losses": self.losses,
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        torch = self.lm.torch
        state = torch.load(path, weights_only=True)
        with torch.no_grad():
            if state["k"].shape != self.prefix.k.shape:
                raise ValueError(
                    f"{path}: a checkpoint of {state['k'].shape[2] + 1} rows, this run trains "
                    f"{self.prefix.p}"
                )
            self.prefix.k.copy_(state["k"])
            self.prefix.v.copy_(state["v"])
            self.prefix.sink_k.copy_(state["sink_k"])
            self.prefix.sink_v.copy_(state["sink_v"])
        self.opt.load_state_dict(state["opt"])
        self.step_no = int(state["step"])
        self.losses = list(state["losses"])


def batch_for(step: int, pool: Sequence[Conversation], size: int, seed: int) -> list[Conversation]:
    """The conversations of optimizer step ``step``: a function of the step alone, so a
    resumed run draws the same batches."""
    rng = random.Random(f"{seed}:batch:{step}")
    return [pool[rng.randrange(len(pool))] for _ in range(size)]


# --------------------------------------------------------------------------- self-study


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
    return Cartridge(k=k, v=v, metadata=model.metadata(len(ids), "prefill"),
                     draft_reference=np.asarray(ids, np.int64))


def self_study(model: Model, corpus_ids: Sequence[int], cfg: TrainConfig, index: int) -> Conversation:
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
                cfg.max_q, cfg.temperature, rng,
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
        student=student_prompt + supervised, start=len(student_prompt), top_ids=top_ids,
        top_logprobs=top_lp, question=question, answer=model.decode(answer_ids), seed=seed,
    )


# --------------------------------------------------------------------------- evaluation


@dataclass
class QA:
    question: str
    answer: str  # the reply is right when it contains this (case-insensitive)


def read_questions(path: str | os.PathLike[str], doc: str | None = None) -> list[QA]:
    """Held-out questions: a JSON list, or JSON lines, of ``{"question", "answer"}``; with
    ``doc``, only those whose ``"doc"`` (when they name one) is ``doc``."""
    text = Path(path).read_text()
    rows = json.loads(text) if text.lstrip().startswith("[") else [
        json.loads(line) for line in text.splitlines() if line.strip()
    ]
    return [
        QA(str(r["question"]), str(r["answer"]))
        for r in rows
        if doc is None or r.get("doc") in (None, doc)
    ]


def answers(
    model: Model,
    questions: Sequence[str],
    cartridge: Cartridge | None,
    *,
    context: str | None = None,
    max_new: int = 32,
    via: str = "engine",
) -> list[str]:
    """The model's greedy replies to ``questions`` behind ``cartridge`` (none: bare), with
    ``context`` as a system message when given; ``via`` "engine" (lmserve's forward pass,
    the cartridge served as ``--cartridge`` serves it) or "torch" (the training copy)."""
    prompts = []
    for q in questions:
        messages = []
        if context is not None:
            messages.append({"role": "system", "content": CONTEXT_PROMPT.format(chunk=context)})
        messages.append({"role": "user", "content": q})
        prompts.append(model.prompt(messages))
    if via == "torch":
        prefix = None if cartridge is None else model.lm.from_cartridge(cartridge)
        got = []
        for at in range(0, len(prompts), 16):
            got.extend(model.lm.generate(prompts[at : at + 16], prefix, max_new, model.stop))
        return [model.decode(g) for g in got]
    from .serve import prefixed

    engine = None if cartridge is None else prefixed(model.backend.model, cartridge)
    rng = random.Random(0)
    return [model.decode(model.sample(q, max_new, 0.0, rng, engine=engine)) for q in prompts]


def accuracy(
    model: Model,
    questions: Sequence[QA],
    cartridge: Cartridge | None,
    *,
    context: str | None = None,
    via: str = "engine",
    log: Callable[[str], None] | None = None,
) -> float:
    """The share of ``questions`` whose greedy reply contains the expected answer."""
    if not questions:
        return float("nan")
    replies = answers(model, [qa.question for qa in questions], cartridge, context=context, via=via)
    right = 0
    for qa, reply in zip(questions, replies, strict=True):
        ok = qa.answer.lower() in reply.lower()
        right += ok
        if log is not None:
            log(f"  [{'ok' if ok else '--'}] {qa.question} -> {reply.strip()[:100]!r}")
    return right / len(questions)


# --------------------------------------------------------------------------- the build


@dataclass
class BuildResult:
    path: Path
    p: int
    steps: int
    conversations: int
    generate_s: float
    train_s: float
    held_out_init: float
    held_out_trained: float
    losses: list[float] = field(default_factory=list)


def _read_pool(path: Path) -> list[Conversation]:
    """The self-study set written so far; a last line cut short by an interrupted run is
    dropped (and the file rewritten without it)."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    pool = []
    for n, line in enumerate(lines):
        try:
            pool.append(Conversation.from_json(line))
        except (json.JSONDecodeError, TypeError):
            if n != len(lines) - 1:
                raise ValueError(f"{path}: line {n + 1} is not a self-study conversation") from None
            path.write_text("".join(c.to_json() + "\n" for c in pool))
    return pool


def build_trained(
    model: Model,
    corpus: str,
    out: str | os.PathLike[str],
    cfg: TrainConfig,
    *,
    work: str | os.PathLike[str] | None = None,
    resume: bool = False,
    say: Callable[[str], None] = print,
) -> BuildResult:
    """Self-study over ``corpus``, train, write the cartridge to ``out``. ``work`` (default
    ``OUT.work``) keeps the self-study set and the checkpoints; ``resume`` continues from
    them."""
    from lmserve_core import progress

    out = Path(out)
    work_dir = Path(work) if work is not None else out.with_name(out.name + ".work")
    work_dir.mkdir(parents=True, exist_ok=True)
    pool_path, state_path = work_dir / "selfstudy.jsonl", work_dir / "state.pt"
    config_path = work_dir / "config.json"
    if not resume and (pool_path.exists() or state_path.exists()):
        raise FileExistsError(f"{work_dir} holds an earlier run: --resume continues it")
    if resume and config_path.is_file():
        saved = json.loads(config_path.read_text())
        if saved.get("p") != cfg.p or saved.get("seed") != cfg.seed:
            raise ValueError(f"{work_dir} was started with p={saved.get('p')} seed={saved.get('seed')}")
    config_path.write_text(json.dumps(asdict(cfg), indent=1))

    corpus_ids = model.encode(corpus)
    if not corpus_ids:
        raise ValueError("the corpus is empty")
    init = prefill_cartridge(model, corpus, cfg.p)
    p = init.p
    if p < cfg.p:
        say(f"the document has {p} tokens: p = {p}")
    k, v = model.lm.from_cartridge(init)
    init_prefix = (k.clone(), v.clone())
    prefix = Prefix(k, v)
    trainer = Trainer(model.lm, prefix, cfg.lr)

    # 1. self-study, appended conversation by conversation (resumable)
    pool = _read_pool(pool_path) if resume else []
    total = cfg.n_conversations()
    report = progress.tracker("cartridge_selfstudy", "self-study", unit="conversations")
    t0 = time.monotonic()
    with open(pool_path, "a") as fh:
        for i in range(len(pool), total):
            conv = self_study(model, corpus_ids, cfg, i)
            fh.write(conv.to_json() + "\n")
            fh.flush()
            pool.append(conv)
            report(i + 1, total)
    generate_s = time.monotonic() - t0
    held, train_pool = pool[: cfg.holdout], pool[cfg.holdout :]
    if not train_pool:
        raise ValueError("no self-study conversations left to train on after the held-out ones")

    # 2. distillation (resumable)
    if resume and state_path.is_file():
        trainer.load(state_path)
        say(f"resumed at step {trainer.step_no} of {cfg.steps}")
    held_init = trainer.held_out(held, init_prefix)
    report = progress.tracker("cartridge_train", "training", unit="steps")
    t0 = time.monotonic()
    while trainer.step_no < cfg.steps:
        trainer.step(batch_for(trainer.step_no, train_pool, cfg.accum, cfg.seed))
        report(trainer.step_no, cfg.steps)
        if trainer.step_no % cfg.save_every == 0 or trainer.step_no == cfg.steps:
            trainer.save(state_path)
    train_s = time.monotonic() - t0
    held_trained = trainer.held_out(held)

    cart = model.lm.to_cartridge(*prefix.full(), model.metadata(p, "trained"))
    cart.draft_reference = np.asarray(corpus_ids, np.int64)  # the whole corpus, for drafts
    cart.metadata.update(steps=str(cfg.steps), lr=str(cfg.lr), conversations=str(len(train_pool)))
    write_cartridge(out, cart)
    return BuildResult(
        out, p, trainer.step_no, len(train_pool), generate_s, train_s, held_init, held_trained,
        trainer.losses,
    )


# --------------------------------------------------------------------------- command line


def add_train_arguments(parser: Any) -> None:
    """The options of ``lmserve cartridge build --train`` (and of ``fleet``)."""
    d = TrainConfig()
    g = parser.add_argument_group("training (--train; needs pip install 'lmserve-core[train]')")
    g.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    g.add_argument("--lr", type=float, default=d.lr, help=f"Adam's learning rate (default {d.lr})")
    g.add_argument("--accum", type=int, default=d.accum,
                   help=f"self-study conversations per step (default {d.accum})")
    g.add_argument("--conversations", type=int, default=0,
                   help="self-study conversations to generate (default: steps x accum / 2)")
    g.add_argument("--holdout", type=int, default=d.holdout,
                   help=f"of those, kept out of training for the held-out loss (default {d.holdout})")
    g.add_argument("--chunk-min", type=int, default=d.chunk_min,
                   help=f"shortest corpus chunk in tokens (default {d.chunk_min})")
    g.add_argument("--chunk-max", type=int, default=d.chunk_max,
                   help=f"longest corpus chunk in tokens (default {d.chunk_max})")
    g.add_argument("--max-answer", type=int, default=d.max_a,
                   help=f"tokens of a self-study answer at most (default {d.max_a})")
    g.add_argument("--seed", type=int, default=d.seed, help="random seed (default 0)")
    g.add_argument("--save-every", type=int, default=d.save_every,
                   help=f"steps between checkpoints (default {d.save_every})")
    g.add_argument("--work", help="directory of the self-study set and checkpoints "
                   "(default: OUT.work)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in the work directory")
    g.add_argument("--eval", metavar="QUESTIONS",
                   help="held-out questions (JSON: [{question, answer, doc?}]) whose accuracy "
                   "is printed without and with the cartridge")


def config_from(args: Any) -> TrainConfig:
    return TrainConfig(
        p=args.p, steps=args.steps, lr=args.lr, accum=args.accum,
        conversations=args.conversations, holdout=args.holdout, chunk_min=args.chunk_min,
        chunk_max=args.chunk_max, max_a=args.max_answer, seed=args.seed,
        save_every=args.save_every, threads=args.threads,
    )


def check_extra() -> None:
    """A clear error when the train extra is not installed."""
    from .file import CartridgeError

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise CartridgeError(
            f"training needs the train extra (pip install 'lmserve-core[train]'): {exc}"
        ) from None


def load_model(args: Any) -> Model:
    """The model of ``lmserve cartridge``'s ``--model`` (the plugin default when absent)."""
    from ..launch import load_backend

    check_extra()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    return Model.from_backend(load_backend(args, 4096))


def report_accuracy(
    model: Model,
    questions: Sequence[QA],
    cartridges: Sequence[tuple[str, Cartridge | None]],
    say: Callable[[str], None] = print,
) -> dict[str, float]:
    """Held-out accuracy of each (label, cartridge), printed."""
    out = {}
    for label, cart in cartridges:
        acc = accuracy(model, questions, cart)
        right = round(acc * len(questions))
        say(f"held-out accuracy {label}: {right}/{len(questions)} ({100 * acc:.0f}%)")
        out[label] = acc
    return out


def build_command(args: Any) -> int:
    """``lmserve cartridge build --train CORPUS OUT``."""
    from .file import read_cartridge

    cfg = config_from(args)
    if cfg.p < 2 or cfg.steps < 0 or cfg.accum < 1 or cfg.lr <= 0:
        raise ValueError("--p must be at least 2, --steps at least 0, --accum at least 1, --lr positive")
    corpus_path = Path(args.corpus)
    text = corpus_path.read_text(encoding="utf-8")
    questions = read_questions(args.eval, corpus_path.stem) if args.eval else []
    model = load_model(args)
    try:
        started = time.perf_counter()
        r = build_trained(model, text, args.out, cfg, work=args.work, resume=args.resume)
        print(
            f"wrote {r.path}: p = {r.p}, {r.steps} steps over {r.conversations} self-study "
            f"conversations; held-out distillation loss {r.held_out_init:.4f} (prefill) -> "
            f"{r.held_out_trained:.4f} (trained); self-study {r.generate_s:.0f} s, training "
            f"{r.train_s:.0f} s, {time.perf_counter() - started:.0f} s in all"
        )
        if questions:
            report_accuracy(model, questions, [
                ("without the cartridge", None),
                ("behind the prefill cartridge", prefill_cartridge(model, text, cfg.p)),
                ("behind the trained cartridge", read_cartridge(r.path)),
            ])
    finally:
        model.close()
    return 0
