"""The prefix mechanism (lmserve_core/cartridge/serve.py) on the real SmolLM2 and Gemma 3
270M, in process: a prefixed cache gives the logits of the document's tokens read first,
past Gemma's sliding window too (ring caches), and after a cut back to the start, a prefix
copy, a snapshot and restore; models that cannot hold one are refused."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmserve_core.cartridge import Cartridge, CartridgeError
from lmserve_core.cartridge.prefill import capture_rows, document_tokens, prefill_cartridge
from lmserve_core.cartridge.serve import PrefixedModel, PrefixRows, cartridge_geometry, prefixed
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "perplexity" / "text.txt"


def _load(name: str, **kwargs: Any) -> tuple[Any, Tokenizer, GGUFFile]:
    from models import gemma3_path, smollm2_path

    if name == "gemma3":
        if importlib.util.find_spec("lmserve_gemma") is None:
            pytest.skip("needs lmserve-gemma")
        from lmserve_gemma.model import Gemma3Model as cls

        path = gemma3_path()
    else:
        if importlib.util.find_spec("lmserve_llama") is None:
            pytest.skip("needs lmserve-llama")
        from lmserve_llama.model import LlamaModel as cls  # type: ignore[assignment]

        path = smollm2_path()
    gguf = GGUFFile.open(path)
    return cls.load(gguf, n_threads=2, **kwargs), Tokenizer.from_gguf(gguf), gguf


def _last(model: Any, cache: Any, tokens: list[int], pos: int, step: int) -> list[np.ndarray]:
    """The last logits of each ``step``-token chunk of ``tokens`` from ``pos``."""
    out = []
    for i in range(0, len(tokens), step):
        out.append(model.forward(cache, tokens[i : i + step], pos + i))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_prefixed_cache_equals_the_document_read_first(name: str) -> None:
    # Gemma: a batch of 16 gives rings of 512 + 16 rows; 32 + 512 positions wrap them, so
    # the prefix's first rows are written over while the conversation goes on
    model, tok, gguf = _load(name, n_batch=16)
    try:
        text = TEXT.read_text()
        doc = document_tokens(tok, text)[:32]
        rest = tok.encode(text[5000:9000], add_special=False)[: 512 if name == "gemma3" else 96]
        served = prefixed(model, prefill_cartridge(model, tok, text, 32))
        assert isinstance(served, PrefixedModel) and served.prefix.p == 32
        cache = served.new_cache(700)
        assert cache.n_ctx == 700
        plain = model.new_cache(732)
        model.forward(plain, doc, 0)
        for a, b in zip(_last(served, cache, rest, 0, 128), _last(model, plain, rest, 32, 128),
                        strict=True):
            np.testing.assert_array_equal(a, b)
        if name == "gemma3":
            assert cache.kind.name == "sliding" and cache.reusable_prefix(len(rest), 10) == 0
        # back to the start: the prefix is there again, whatever the rings wrote over it
        cache.truncate(0)
        again = served.forward(cache, rest[:20], 0)
        fresh = model.new_cache(64)
        model.forward(fresh, doc, 0)
        np.testing.assert_array_equal(again, model.forward(fresh, rest[:20], 32))
        # a copy of the first 20 positions, and a snapshot restored into another cache
        other = served.new_cache(700)
        served.copy_rows(cache, other, 20)
        np.testing.assert_array_equal(
            served.forward(other, rest[20:30], 20), model.forward(fresh, rest[20:30], 52)
        )
        state = cache.snapshot(20)
        third = served.new_cache(700)
        third.restore(20, state)
        np.testing.assert_array_equal(
            served.forward(third, rest[20:30], 20), model.forward(fresh, rest[20:30], 52)
        )
        # batched rows behind the prefix: each as alone
        a, b = served.new_cache(64), served.new_cache(64)
        outs = served.forward_batch([(a, rest[:5], 0), (b, rest[40:47], 0)])
        np.testing.assert_array_equal(outs[0][-1], served.forward(served.new_cache(64), rest[:5], 0))
        np.testing.assert_array_equal(
            outs[1][-1], served.forward(served.new_cache(64), rest[40:47], 0)
        )
    finally:
        model.close()
        gguf.close()


def test_capture_reads_keys_after_norm_and_rope() -> None:
    """The rows a cartridge holds are the cache's own: serving them as a prefix gives the
    next token's logits of the document read in the same chunks."""
    model, tok, gguf = _load("smollm2")
    try:
        ids = document_tokens(tok, "The capital of France is Paris. The capital of Italy is")
        k, v = capture_rows(model, ids[:-1])
        assert k[0].shape == (len(ids) - 1, 3, 64)
        served = PrefixedModel(model, PrefixRows(Cartridge(k=k, v=v)))
        behind = served.forward(served.new_cache(16), ids[-1:], 0)
        plain = model.new_cache(64)
        model.forward(plain, ids[:-1], 0)
        np.testing.assert_array_equal(behind, model.forward(plain, ids[-1:], len(ids) - 1))
        # the prefix changes the answer: without it the last token alone reads otherwise
        alone = model.forward(model.new_cache(16), ids[-1:], 0)
        assert not np.array_equal(alone, behind)
    finally:
        model.close()
        gguf.close()


def test_geometry_mismatch_names_layer_and_shape() -> None:
    model, _tok, gguf = _load("smollm2")
    try:
        rng = np.random.default_rng(0)
        shapes = [(5, 3, 64)] * 29 + [(5, 4, 64)]
        bad = Cartridge(k=[rng.standard_normal(s).astype(np.float32) for s in shapes],
                        v=[rng.standard_normal(s).astype(np.float32) for s in shapes])
        with pytest.raises(CartridgeError, match=r"layers\.29\.k has shape \[4, 4, 64\].*\[4, 3, 64\]"):
            prefixed(model, bad)
        short = Cartridge(k=bad.k[:3], v=bad.v[:3])
        with pytest.raises(CartridgeError, match="3 layers, the model has 30"):
            prefixed(model, short)
    finally:
        model.close()
        gguf.close()


@pytest.mark.parametrize(
    ("module", "cls", "layers"),
    [
        ("lmserve_qwen35.model", "Qwen35Model", [(2, 64, 64, 0, 100), (2, 64, 64, 0, 0)]),
        ("lmserve_nanochat.model", "NanochatModel", [(2, 64, 64, 0, 0)]),
        ("lmserve_inkling.model", "InklingModel", [(2, 64, 64, 0, 0)]),
        ("lmserve_gemma.dgemma_model", "DiffusionGemmaModel", [(2, 64, 64, 0, 0)]),
    ],
)
def test_families_without_plain_rows_refuse(module: str, cls: str, layers: list[Any]) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"needs {module.split('.')[0]}")
    model = getattr(importlib.import_module(module), cls).__new__(
        getattr(importlib.import_module(module), cls)
    )
    model.cache_layers = layers
    with pytest.raises(CartridgeError, match=f"cannot serve a cartridge: its family \\({cls}\\)"):
        cartridge_geometry(model)


@pytest.mark.parametrize(
    ("module", "cls"),
    [
        ("lmserve_llama.model", "LlamaModel"),
        ("lmserve_qwen3.model", "Qwen3Model"),
        ("lmserve_gemma.model", "Gemma3Model"),
        ("lmserve_gemma.gemma4_model", "Gemma4Model"),
    ],
)
def test_families_of_plain_rows_serve(module: str, cls: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"needs {module.split('.')[0]}")
    kind = getattr(importlib.import_module(module), cls)
    model = kind.__new__(kind)
    model.cache_layers = [(2, 64, 64, 0, 0), (1, 256, 256, 1024, 0)]
    assert cartridge_geometry(model) == ([2, 1], [64, 256])
    model.cache_layers = [(2, 64, 64, 0, 16)]  # a recurrent layer: never
    with pytest.raises(CartridgeError, match="layer 0 is recurrent"):
        cartridge_geometry(model)


def test_caches_behind_other_prefixes_share_one_model() -> None:
    """The seams a fleet composes with: several cartridges as one prefix, and a cache that
    changes the prefix it stands behind; positions count from each cache's own prefix."""
    model, tok, gguf = _load("smollm2")
    try:
        a = prefill_cartridge(model, tok, "Edda keeps the lighthouse on Varnholm.", 6)
        b = prefill_cartridge(model, tok, "The supply boat is called Marigold.", 5)
        both = PrefixRows.composed([a, b])
        assert both.p == 11
        np.testing.assert_array_equal(both.k[3][6:], b.k[3].reshape(5, -1))
        served = prefixed(model, a)
        ids = tok.encode(" Who is it?", add_special=False)
        want = served.forward(served.new_cache(32, prefix=both), ids, 0)
        cache = served.new_cache(32)
        first = served.forward(cache, ids, 0)
        cache.stand_behind(both)
        assert cache.n_ctx == 32 + 6 - 11
        np.testing.assert_array_equal(served.forward(cache, ids, 0), want)
        assert not np.array_equal(first, want)
        other = served.new_cache(32)
        served.copy_rows(cache, other, len(ids))  # the copy stands behind the donor's prefix
        assert other.prefix is both
        np.testing.assert_array_equal(
            served.forward(other, ids[-1:], len(ids) - 1), served.forward(cache, ids[-1:], len(ids) - 1)
        )
        with pytest.raises(CartridgeError, match="do not compose"):
            PrefixRows.composed([a, Cartridge(k=[x[:, :1] for x in b.k], v=[x[:, :1] for x in b.v])])
    finally:
        model.close()
        gguf.close()


def test_slots_lend_prefixes_only_behind_the_same_rows() -> None:
    """SlotPool.adopt(prompt, behind=prefix): the slot pool of a server whose conversations
    stand behind different prefixes (a fleet) reuses a slot only behind the same one."""
    from lmserve_core.kv_slots import SlotPool

    model, tok, gguf = _load("smollm2")
    try:
        a = PrefixRows(prefill_cartridge(model, tok, "Edda keeps the lighthouse on Varnholm.", 6))
        b = PrefixRows(prefill_cartridge(model, tok, "The supply boat is called Marigold.", 5))
        served = PrefixedModel(model, a)
        pool = SlotPool(2, lambda: served.new_cache(64), served.copy_rows)
        first = tok.encode("Who keeps the light there?", add_special=False)
        slot, n = pool.adopt(first, behind=a)
        assert n == 0 and slot.cache.prefix is a
        served.forward(slot.cache, first, 0)
        slot.tokens.extend(first)
        longer = [*first, *tok.encode(" And the boat?", add_special=False)]
        other, n = pool.adopt(longer, behind=b)  # the same tokens behind other rows: no reuse
        assert n == 0 and other is not slot and other.cache.prefix is b
        np.testing.assert_array_equal(
            served.forward(other.cache, longer, 0),
            served.forward(served.new_cache(64, prefix=b), longer, 0),
        )
        other.tokens.extend(longer)
        again, n = pool.adopt(longer, behind=a)  # behind a: the first slot continues
        assert again is slot and n == len(first)
        # a slot taken from another prefix stands behind the new one, from the start
        third, n = pool.adopt(tok.encode("Unrelated words here.", add_special=False), behind=a)
        assert n == 0 and third is other and third.cache.prefix is a and not third.tokens
    finally:
        model.close()
        gguf.close()
