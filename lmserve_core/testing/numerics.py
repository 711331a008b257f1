"""Helpers of the families' numerical tests: greedy decoding on both sides of a comparison,
llama-perplexity's scoring rule, and the loading of a test module's references. torch is
imported only by the functions that run a transformers reference."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from lmserve_core.native import kernels

R = TypeVar("R")


@contextlib.contextmanager
def f32_products() -> Iterator[None]:
    """Run a block on the reference path: f32 activations in every product, decode's
    included (the server's default gives decode int16 activations; the families' numerics
    tests compare the f32 path with transformers and the int16 one with both)."""
    with (
        kernels.use_decode_precision(kernels.DecodePrecision.F32),
        kernels.use_prefill_precision(kernels.PrefillPrecision.F32),
    ):
        yield


@contextlib.contextmanager
def int16_products() -> Iterator[None]:
    """Run a block with every product that has an int16 path on it (the default: decode's
    products, and prefill's on the interleaved matrices)."""
    with (
        kernels.use_decode_precision(kernels.DecodePrecision.I16),
        kernels.use_prefill_precision(kernels.PrefillPrecision.I16),
    ):
        yield


def chunk_nll(logits: np.ndarray, ids: Sequence[int], first: int) -> tuple[float, int]:
    """Summed NLL of ids[j + 1] given logits[j] for j in [first, len(ids) - 1), in float64,
    and how many tokens it scored (llama-perplexity's rule scores the second half of each
    chunk: ``first = n_ctx // 2``)."""
    scored = logits[first:-1].astype(np.float64)
    targets = np.asarray(ids[first + 1 :])
    top = scored.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(scored - top).sum(axis=1))
    nll = log_z - scored[np.arange(len(targets)), targets]
    return float(nll.sum()), len(targets)


def stepped_logits(model: Any, ids: Sequence[int]) -> np.ndarray:
    """A ``ForwardModel``'s logits of ``ids`` one token per forward, as decode runs."""
    cache = model.new_cache(len(ids))
    return np.stack([model.forward(cache, [t], pos) for pos, t in enumerate(ids)])


def check_batched_decode(model: Any, prompts: Sequence[Sequence[int]], n_steps: int = 8) -> None:
    """Greedy decode steps of several sequences run together (``forward_batch``) give
    bit-identical logits to each sequence run alone, on the default int16 products: a
    request's tokens do not depend on what else is in its batch. Sequences sit at different
    positions; every other step the last one sits out, and at step 2 the first one writes
    two tokens."""
    with int16_products():
        n_ctx = max(len(p) for p in prompts) + 2 * n_steps + 4
        alone = [model.new_cache(n_ctx) for _ in prompts]
        batch = [model.new_cache(n_ctx) for _ in prompts]
        for a, b, p in zip(alone, batch, prompts, strict=True):
            model.forward(a, list(p), 0)
            model.forward(b, list(p), 0)
        pos = [len(p) for p in prompts]
        nxt = [int(p[-1]) for p in prompts]
        for step in range(n_steps):
            members = range(len(prompts) - (step % 2))
            rows = [(i, [nxt[i]] * (2 if step == 2 and i == 0 else 1)) for i in members]
            outs = model.forward_batch([(batch[i], toks, pos[i]) for i, toks in rows])
            for (i, toks), got in zip(rows, outs, strict=True):
                want = model.forward(alone[i], toks, pos[i], all_logits=True)
                assert got.shape == want.shape
                diff = float(np.abs(got - want).max())
                assert np.array_equal(got, want), f"step {step}, sequence {i}: max |diff| {diff}"
                pos[i] += len(toks)
                nxt[i] = int(np.argmax(got[-1]))


def perplexity(model: Any, chunks: Sequence[Sequence[int]], first: int) -> float:
    """exp(mean NLL) of a ``ForwardModel`` over chunks each run from an empty cache, scored
    from position ``first`` as :func:`chunk_nll` does."""
    cache = model.new_cache(max(len(c) for c in chunks))
    total, count = 0.0, 0
    for ids in chunks:
        nll, n = chunk_nll(model.forward(cache, list(ids), 0, all_logits=True), ids, first)
        total += nll
        count += n
    return float(np.exp(total / count))


def greedy(model: Any, ids: Sequence[int], n_new: int) -> list[int]:
    """``n_new`` greedy tokens of a ``ForwardModel`` after ``ids`` (prefill, then one token
    per forward)."""
    cache = model.new_cache(len(ids) + n_new)
    logits = model.forward(cache, list(ids), 0)
    out: list[int] = []
    for step in range(n_new):
        out.append(int(np.argmax(logits)))
        if step + 1 < n_new:
            logits = model.forward(cache, [out[-1]], len(ids) + step)
    return out


def reference_greedy(reference: Any, ids: Sequence[int], n_new: int, *, exact: bool = False) -> list[int]:
    """A transformers model's greedy continuation of ``ids``: ``n_new`` tokens, or fewer
    when it ends with its EOS (``exact`` forces all ``n_new``)."""
    import torch

    with torch.no_grad():
        out = reference.generate(
            torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n_new,
            min_new_tokens=n_new if exact else None,
            do_sample=False,
            num_beams=1,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :].tolist()]


def assert_greedy_matches(
    model: Any, reference: Any, ids: Sequence[int], n_new: int, tie: float
) -> list[int]:
    """A ``ForwardModel``'s greedy continuation equals the transformers reference's, or first
    departs from it at a near tie: where the reference's logits of the two choices lie within
    ``tie``. Returns ours."""
    import torch

    want = reference_greedy(reference, ids, n_new)  # shorter when it ends with its EOS
    got = greedy(model, ids, len(want))
    if got != want:
        k = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        with torch.no_grad():
            ref = reference(torch.tensor([[*ids, *want[:k]]])).logits[0, -1].float().numpy()
        gap = abs(float(ref[want[k]]) - float(ref[got[k]]))
        assert gap < tie, f"departs at {k}: ours {got[k]}, reference {want[k]}, gap {gap:.3g}"
    return got


def check_int16_products(
    model: Any, reference: Any, prompts: Sequence[Sequence[int]], atol: float
) -> None:
    """The int16 paths of a real model next to its transformers reference: for each prompt,
    token-by-token (decode) logits and the logits of the prompt read in one pass (prefill)
    within ``atol`` with the same top-1 everywhere, and greedy continuations equal up to a
    near tie (``2 * atol``)."""
    import torch

    for ids in prompts:
        with int16_products():
            got = {
                "decode": stepped_logits(model, ids),
                "prefill": model.forward(model.new_cache(len(ids)), list(ids), 0, all_logits=True),
            }
        with torch.no_grad():
            want = reference(torch.tensor([list(ids)])).logits[0].float().numpy()
        for path, logits in got.items():
            diff = np.abs(logits - want)
            print(f"int16 {path}: {len(ids)} tokens, max |diff| {diff.max():.3g}, "
                  f"mean {diff.mean():.3g}")
            assert diff.max() < atol
            assert (logits.argmax(axis=1) == want.argmax(axis=1)).all()
        with int16_products():
            assert_greedy_matches(model, reference, ids, 32, 2 * atol)


def int16_perplexity_gap(
    model: Any, chunked: Any, chunks: Sequence[Sequence[int]], first: int
) -> tuple[float, float, float]:
    """Perplexity of ``model`` on the f32 path; of ``chunked`` (the same weights loaded with
    chunks under 32 tokens, so every product takes the integer path) on int16; and of
    ``model`` on the default int16 path (whole-chunk prefill: its products on int16 where the
    matrices are interleaved, in f32 elsewhere)."""
    with f32_products():
        f32 = perplexity(model, chunks, first)
    with int16_products():
        i16 = perplexity(chunked, chunks, first)
        prefill = perplexity(model, chunks, first)
    print(f"perplexity: f32 {f32:.6f}, int16 decode products {i16:.6f}, int16 prefill {prefill:.6f}")
    return f32, i16, prefill


def gguf_reference(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """transformers' float32 model of a GGUF, read by transformers itself (its own
    dequantization and modelling code), in eval mode. torch runs on one thread: on a busy
    2-core machine its OpenMP barriers stall whenever the other core is taken."""
    import torch
    import transformers

    torch.set_num_threads(1)
    directory, name = os.path.split(os.fspath(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, **kwargs
    )
    return model.eval()


def load_json(path: Path) -> dict[str, Any]:
    """A recorded reference run (e.g. llama-perplexity's); the test skips when it is missing."""
    if not path.exists():
        pytest.skip(f"{path.name} (a recorded reference run) is missing")
    return dict(json.loads(path.read_text(encoding="utf-8")))


@pytest.fixture(autouse=True)
def f32_reference_path() -> Iterator[None]:
    """Every test of a module that imports this fixture on the reference path: f32
    activations in every product. The served default, int16 activations in decode's
    products, has its own tests."""
    with f32_products():
        yield


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> None:
    """torch on one thread for the tests of a module that imports this fixture: its OpenMP
    barriers stall on a busy 2-core machine; one thread is steadier."""
    import torch

    torch.set_num_threads(1)


def reference_loader(load: Callable[[str, Any], R]) -> Callable[..., R]:
    """``reference(synthetic, kind, type="f32")``: ``load(kind, model)`` of the synthetic
    model ``synthetic(kind=kind, type=type)`` (``synthetic`` the families' fixture), loaded
    once per kind and type and kept for the rest of the session."""
    loaded: dict[tuple[str, str], R] = {}

    def reference(synthetic: Callable[..., Any], kind: str, type: str = "f32") -> R:
        key = (kind, type)
        if key not in loaded:
            loaded[key] = load(kind, synthetic(kind=kind, type=type))
        return loaded[key]

    return reference
