"""Embeddings and reranking over a served model's forward pass.

An embedding GGUF declares how its hidden states are pooled (``{arch}.pooling_type``, as
llama.cpp's converter writes it from sentence-transformers' pooling config): ``mean``,
``cls`` (the first token), ``last`` (Qwen3-Embedding) or ``rank`` (a reranker: the last
token through the classifier head ``cls.output``, Qwen3-Reranker's "yes" and "no" rows of
the LM head). A chat model started with ``--embeddings`` pools its last token; ``--pooling``
overrides either.

The states are the last layer's after the final norm, as transformers' ``last_hidden_state``;
embeddings are L2-normalised. The inputs of a request run together, packed into weight
passes of up to ``n_batch`` tokens, on the engine's worker (``Engine.call``); requests queued
meanwhile join them (``queue`` and ``run_queued``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from .backend import HasModel
from .errors import InvalidRequest
from .gguf_file import GGUFFile

log = structlog.get_logger("lmserve.embeddings")

# llama.cpp's enum llama_pooling_type, by value
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")
POOLINGS = POOLING_TYPES[1:]  # what --pooling takes
RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"
SOFTMAX_RANKERS = ("qwen3", "qwen3vl")


def file_pooling(gguf: GGUFFile) -> str | None:
    """The pooling the file declares, or None (a model that does not embed)."""
    value = gguf.arch_get("pooling_type")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < len(POOLING_TYPES):
        raise ValueError(f"{gguf.path}: unknown {gguf.architecture}.pooling_type {value!r}")
    name = POOLING_TYPES[int(value)]
    return None if name == "none" else name


@dataclass(frozen=True, slots=True)
class Pooled:
    """What a batch of inputs gave: a row per input, and the tokens read."""

    rows: np.ndarray  # (inputs, n_embd) embeddings, or (inputs,) rerank scores
    tokens: int


@dataclass(eq=False)
class _Job:
    """A request's inputs waiting for the worker."""

    inputs: Sequence[Sequence[int]]
    rank: bool
    future: Future[Pooled] = field(default_factory=Future)


class Embedder:
    """Pools a backend's hidden states: embeddings (``embed``) or rerank scores (``rank``).

    ``model`` is a :class:`~lmserve_core.kit.NativeForwardModel` (``hidden_batch``,
    ``new_cache``, ``n_batch``); ``max_tokens`` bounds one input.
    """

    def __init__(
        self, model: Any, tokenizer: Any, gguf: GGUFFile, pooling: str, max_tokens: int
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        if not callable(getattr(model, "hidden_batch", None)):
            raise ValueError(f"{type(model).__name__} does not report hidden states to embed")
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_tokens = int(max_tokens)
        self.n_embd = int(gguf.arch_get("embedding_length", 0))
        self.head: np.ndarray | None = None
        self.head_bias: np.ndarray | None = None
        self.rerank_template: str | None = None
        self.labels: list[str] = []
        self.softmax = False
        # a reranker's embeddings are its last token's states
        self._embed_pooling = "last" if pooling == "rank" else pooling
        self._queued: list[_Job] = []
        self._queue_lock = threading.Lock()
        if pooling == "rank":
            self.head, self.head_bias = _classifier_head(gguf)
            template = gguf.get(RERANK_TEMPLATE_KEY)
            self.rerank_template = template if isinstance(template, str) else None
            labels = gguf.arch_get("classifier.output_labels")
            self.labels = [str(x) for x in labels] if isinstance(labels, list) else []
            if self.head.shape[1] != self.n_embd:
                raise ValueError(
                    f"{gguf.path}: cls.output has rows of {self.head.shape[1]}, "
                    f"not n_embd {self.n_embd}"
                )
            # Qwen3-Reranker's two rows are "yes" and "no": the score is P(yes), a softmax
            # over the pair, as llama.cpp reads it (for these architectures only)
            self.softmax = gguf.architecture in SOFTMAX_RANKERS and self.head.shape[0] == 2

    @property
    def ranks(self) -> bool:
        return self.pooling == "rank"

    # ------------------------------------------------------------------ inputs

    def tokens(self, text: str) -> list[int]:
        """Token ids of one input text, the file's BOS/EOS added and special tokens parsed
        (as llama-server embeds them)."""
        ids: list[int] = self.tokenizer.encode(text, add_special=True, parse_special=True)
        return ids

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """The prompt a reranker judges: the file's ``rerank`` template with the query and
        the document put in, or (a file without one) the query, EOS and the document."""
        if self.rerank_template is not None:
            prompt = self.rerank_template.replace("{query}", query).replace("{document}", document)
            ids: list[int] = self.tokenizer.encode(prompt, add_special=False, parse_special=True)
            return ids
        query_ids = self.tokenizer.encode(query, add_special=False, parse_special=False)
        doc_ids = self.tokenizer.encode(document, add_special=False, parse_special=False)
        eos = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        return [*query_ids, *eos, *doc_ids, *eos]

    def check(self, inputs: Sequence[Sequence[int]], field: str) -> None:
        """Raise InvalidRequest for an empty input, an id outside the vocabulary or an
        input longer than ``max_tokens``, naming its index."""
        if not inputs:
            raise InvalidRequest(f"'{field}' must not be empty", param=field)
        vocab = int(self.model.n_vocab)
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequest(f"'{field}[{i}]' is empty", param=field)
            for token in ids:
                if not 0 <= token < vocab:
                    raise InvalidRequest(
                        f"'{field}[{i}]': token id {token} is outside the vocabulary [0, {vocab})",
                        param=field,
                    )
            if len(ids) > self.max_tokens:
                raise InvalidRequest(
                    f"'{field}[{i}]' has {len(ids)} tokens; this model reads at most "
                    f"{self.max_tokens} per input",
                    param=field,
                    code="context_length_exceeded",
                )

    # ------------------------------------------------------------------ on the worker

    def embed(self, inputs: Sequence[Sequence[int]]) -> Pooled:
        """L2-normalised embeddings of ``inputs`` (token ids), ``(len(inputs), n_embd)``."""
        return self._finish(False, inputs, self._pool(inputs, self._embed_pooling))

    def rank(self, inputs: Sequence[Sequence[int]]) -> Pooled:
        """The relevance score of each input (a rerank prompt)."""
        return self._finish(True, inputs, self._pool(inputs, "last"))

    def queue(self, inputs: Sequence[Sequence[int]], *, rank: bool) -> Future[Pooled]:
        """Hold a request's inputs for the next :meth:`run_queued`; the future gets what
        :meth:`rank` or :meth:`embed` would return."""
        job = _Job(inputs, rank)
        with self._queue_lock:
            self._queued.append(job)
        return job.future

    def withdraw(self, future: Future[Pooled]) -> None:
        """Drop a queued request (its call was refused) unless it already ran."""
        with self._queue_lock:
            self._queued = [job for job in self._queued if job.future is not future]

    def run_queued(self) -> None:
        """Every queued request's inputs through the forward pass together (on the worker):
        requests that arrive while the worker is busy share passes, as one request's inputs
        do. A later call finds its request already done and returns."""
        with self._queue_lock:
            jobs, self._queued = self._queued, []
        for rank in (False, True):
            group = [job for job in jobs if job.rank is rank]
            if not group:
                continue
            inputs = [ids for job in group for ids in job.inputs]
            try:
                states = self._pool(inputs, "last" if rank else self._embed_pooling)
            except Exception as exc:  # each request gets the failure
                for job in group:
                    job.future.set_exception(exc)
                continue
            start = 0
            for job in group:
                end = start + len(job.inputs)
                job.future.set_result(self._finish(rank, job.inputs, states[start:end]))
                start = end

    def _finish(self, rank: bool, inputs: Sequence[Sequence[int]], states: np.ndarray) -> Pooled:
        tokens = sum(len(x) for x in inputs)
        if not rank:
            norms = np.linalg.norm(states, axis=1, keepdims=True)
            return Pooled(states / np.maximum(norms, 1e-12), tokens)
        assert self.head is not None
        logits = states.astype(np.float64) @ self.head.T.astype(np.float64)
        if self.head_bias is not None:
            logits += self.head_bias
        # softmax over the pair, or the one logit as it is
        scores = 1.0 / (1.0 + np.exp(logits[:, 1] - logits[:, 0])) if self.softmax else logits[:, 0]
        return Pooled(scores, tokens)

    def _pool(self, inputs: Sequence[Sequence[int]], pooling: str) -> np.ndarray:
        """The pooled final-normed states of each input, float32 ``(inputs, n_embd)``.

        The inputs go through the forward pass together: each weight pass takes a piece of
        as many of them as fit ``n_batch`` tokens (an input longer than that continues in
        the next pass on its own cache), so a request of many short inputs costs a few
        passes, not one per input.
        """
        model = self.model
        n = len(inputs)
        done = [0] * n
        sums: list[np.ndarray | None] = [None] * n
        caches: dict[int, Any] = {}
        budget_per_pass = int(model.n_batch)
        try:
            first = 0  # inputs before it are done
            while first < n:
                rows: list[tuple[int, int, int]] = []  # (input, start, end)
                budget = budget_per_pass
                i = first
                while i < n and budget > 0:
                    start = done[i]
                    end = min(len(inputs[i]), start + budget)
                    if i not in caches:
                        caches[i] = model.new_cache(len(inputs[i]))
                    rows.append((i, start, end))
                    budget -= end - start
                    i += 1
                states = model.hidden_batch(
                    [(caches[j], list(inputs[j][a:b]), a) for j, a, b in rows]
                )
                for (j, a, b), h in zip(rows, states, strict=True):
                    if pooling == "mean":
                        part = h.sum(axis=0, dtype=np.float64)
                        sums[j] = part if sums[j] is None else sums[j] + part
                    elif pooling == "cls" and a == 0:
                        sums[j] = h[0].astype(np.float64)
                    elif pooling == "last" and b == len(inputs[j]):
                        sums[j] = h[-1].astype(np.float64)
                    done[j] = b
                    if b == len(inputs[j]):
                        _close(caches.pop(j))
                while first < n and done[first] == len(inputs[first]):
                    first += 1
        finally:
            for cache in caches.values():
                _close(cache)
        out = np.stack([s for s in sums if s is not None])
        if pooling == "mean":
            out /= np.array([len(x) for x in inputs], np.float64)[:, None]
        return out.astype(np.float32)


def _classifier_head(gguf: GGUFFile) -> tuple[np.ndarray, np.ndarray | None]:
    """``cls.output.weight`` (labels, n_embd) and its bias, decoded to float32."""
    from .native import kernels

    def decoded(name: str) -> np.ndarray | None:
        info = gguf.tensors.get(name)
        if info is None:
            return None
        if info.ggml_type == int(kernels.QuantType.F32):
            flat = info.data.view(np.float32)
        else:
            flat = kernels.dequantize_row(info.ggml_type, info.data, info.n_elements)
        return np.asarray(flat, np.float32).reshape(info.shape).copy()

    weight = decoded("cls.output.weight")
    if weight is None or weight.ndim != 2:
        raise ValueError(f"{gguf.path}: a ranking model needs its classifier head cls.output")
    return weight, decoded("cls.output.bias")


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def embedder_for(
    backend: Any, *, enabled: bool = False, pooling: str | None = None
) -> Embedder | None:
    """The embedder a served backend gets: when its file declares a pooling, or when asked
    (``enabled``, or a ``pooling``); None otherwise. Raises ValueError when the backend
    cannot embed."""
    served = isinstance(backend, HasModel) and isinstance(backend.gguf, GGUFFile)
    declared = file_pooling(backend.gguf) if served else None
    if declared is None and not enabled and pooling is None:
        return None
    if not served:
        raise ValueError(f"the {backend.name} backend does not embed")
    gguf = backend.gguf
    chosen = pooling or declared or "last"
    embedder = Embedder(
        backend.model, backend.tokenizer, gguf, chosen, max_tokens=backend.context_length
    )
    log.info("embeddings", pooling=chosen, declared=declared, n_embd=embedder.n_embd)
    return embedder
