"""NanochatModel against nanochat's own gpt.py (two generations) and transformers' port.

Every comparison runs the f32 products and an f32 cache, and holds within the families'
bound for float32: ``2e-4 * max |logit|``. The paths that reach a chunk's first row from
elsewhere (decode, chunks, prefix copies, restored snapshots, rollbacks, batches) are each
compared with the one-pass reference: the smear reads the token before the chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from lmserve_nanochat.model import NanochatCache, NanochatModel
from lmserve_nanochat.view import build_view, config_from_view
from tiny_nanochat import TinyModel

from lmserve_core.testing.numerics import check_batched_decode, f32_products, greedy

Tiny = Callable[[str], TinyModel]
KINDS = ("smear", "ve32", "hf")
# prompts longer than the tiny models' windows: smear's long window is 65 keys, ve32's are
# 17 and 33; the hf port has none (its prompts stay within its 64 positions)
PROMPT = {"smear": 80, "ve32": 48, "hf": 40}


def load(tm: TinyModel, *, weights: str = "f32", n_batch: int = 64) -> NanochatModel:
    view = build_view(tm.config, tm.tensors, path=tm.path, weights=weights)
    return NanochatModel.load(view, n_threads=2, n_batch=n_batch, kv_type="f32")


def prompt(tm: TinyModel, n: int | None = None, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    n = n or PROMPT[tm.spec.kind]
    return [int(t) for t in rng.integers(0, tm.config.vocab_size, n)]


def subject(tiny: Tiny, kind: str, n: int, seed: int) -> tuple[TinyModel, list[int], np.ndarray, NanochatModel]:
    """A tiny model of ``kind``, a prompt of ``n`` tokens, the reference's logits of it and
    the model loaded."""
    tm = tiny(kind)
    ids = prompt(tm, n, seed=seed)
    return tm, ids, tm.logits(ids), load(tm)


def close(got: np.ndarray, want: np.ndarray, what: str, rel: float = 2e-4) -> None:
    diff = float(np.abs(got - want).max())
    print(f"{what}: max |diff| {diff:.3g} (max |logit| {np.abs(want).max():.3g})")
    assert diff <= rel * float(np.abs(want).max()), what


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logits_match_the_reference(tiny: Tiny, kind: str) -> None:
    tm = tiny(kind)
    ids = prompt(tm)
    want = tm.logits(ids)
    model = load(tm)
    with f32_products():
        got = model.forward(model.new_cache(len(ids)), ids, 0, all_logits=True)
    assert got.shape == (len(ids), tm.config.vocab_size) and got.dtype == np.float32
    close(got, want, f"{kind} prompt")


@pytest.mark.parametrize("kind", ["smear", "ve32"])
def test_chunks_and_decode_match_the_reference(tiny: Tiny, kind: str) -> None:
    tm = tiny(kind)
    ids = prompt(tm, seed=1)
    want = tm.logits(ids)
    # n_batch 7: one forward call runs several chunks (the model carries the smear's token)
    model = load(tm, n_batch=7)
    with f32_products():
        close(model.forward(model.new_cache(len(ids)), ids, 0, all_logits=True), want,
              f"{kind} in chunks of 7")
        cache = model.new_cache(len(ids))
        got, pos = [], 0
        for n in (5, 1, 13, 2, 7, 30):  # calls of their own, then one token at a time
            got.append(model.forward(cache, ids[pos : pos + n], pos, all_logits=True))
            pos += n
        for p in range(pos, len(ids)):
            got.append(model.forward(cache, ids[p : p + 1], p, all_logits=True))
    close(np.concatenate(got), want, f"{kind} calls then decode")


@pytest.mark.parametrize("kind", ["smear", "ve32"])
def test_batched_decode_equals_single(tiny: Tiny, kind: str) -> None:
    tm = tiny(kind)
    check_batched_decode(load(tm), [prompt(tm, 9, seed=2), prompt(tm, 14, seed=3)])


def test_batch_rows_match_the_reference(tiny: Tiny) -> None:
    tm = tiny("smear")
    a, b = prompt(tm, 30, seed=4), prompt(tm, 30, seed=5)
    want_a, want_b = tm.logits(a), tm.logits(b)
    model = load(tm)
    ca, cb = model.new_cache(30), model.new_cache(30)
    with f32_products():
        model.forward(ca, a[:20], 0)
        model.forward(cb, b[:11], 0)
        got_a, got_b = model.forward_batch([(ca, a[20:23], 20), (cb, b[11:12], 11)])
    close(got_a, want_a[20:23], "batch row of 3 tokens")
    close(got_b, want_b[11:12], "batch row of 1 token")


@pytest.mark.parametrize("kind", ["smear", "ve32"])
def test_copy_rows_then_continue(tiny: Tiny, kind: str) -> None:
    _, ids, want, model = subject(tiny, kind, 40, 6)
    with f32_products():
        donor = model.new_cache(40)
        model.forward(donor, ids[:30], 0)
        cache = model.new_cache(40)
        model.copy_rows(donor, cache, 17)
        got = model.forward(cache, ids[17:25], 17, all_logits=True)
        step = model.forward(cache, ids[25:26], 25)
    close(got, want[17:25], f"{kind} chunk after copy_rows")
    close(step, want[25], f"{kind} decode after copy_rows")


def test_snapshot_restore_then_continue(tiny: Tiny) -> None:
    tm, ids, want, model = subject(tiny, "smear", 40, 7)
    with f32_products():
        donor = model.new_cache(40)
        model.forward(donor, ids[:24], 0)
        state = donor.snapshot(24)
        cache = model.new_cache(40)
        cache.restore(24, state)
        assert isinstance(cache, NanochatCache) and cache.tokens[:24].tolist() == ids[:24]
        got = model.forward(cache, ids[24:], 24, all_logits=True)
    close(got, want[24:], "after restore")
    # the token before the chunk matters: the same rows with another token at 23 differ
    cache.restore(24, state)
    cache.tokens[23] = (ids[23] + 1) % tm.config.vocab_size
    with f32_products():
        other = model.forward(cache, ids[24:], 24, all_logits=True)
    assert np.abs(other[0] - want[24]).max() > 1e-2 * np.abs(want).max()
    with pytest.raises(ValueError):
        model.new_cache(40).restore(24, state[:50])


def test_rollback_then_continue(tiny: Tiny) -> None:
    """A verify pass writes drafted tokens; after a rejection the next forward starts at an
    earlier position, the accepted tokens before it kept."""
    tm, ids, want, model = subject(tiny, "smear", 30, 8)
    with f32_products():
        cache = model.new_cache(30)
        model.forward(cache, ids[:20], 0)
        wrong = [(t + 1) % tm.config.vocab_size for t in ids[21:24]]
        model.forward(cache, [ids[20], *wrong], 20, all_logits=True)  # 1 accepted, 3 not
        got = model.forward(cache, ids[21:], 21, all_logits=True)
    close(got, want[21:], "after a rollback")


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_continuation_equals_the_reference(tiny: Tiny, kind: str) -> None:
    tm = tiny(kind)
    ids = prompt(tm, 12, seed=9)
    with f32_products():
        got = greedy(load(tm), ids, 20)
    assert got == tm.greedy(ids, 20)


@pytest.mark.parametrize(("weights", "rel"), [("bf16", 2e-2), ("f16", 2e-3), ("q8_0", 5e-2)])
def test_reduced_weights_stay_close(tiny: Tiny, weights: str, rel: float) -> None:
    tm = tiny("smear")
    ids = prompt(tm, 40, seed=10)
    want = tm.logits(ids)
    model = load(tm, weights=weights)
    with f32_products():
        got = model.forward(model.new_cache(40), ids, 0, all_logits=True)
    close(got, want, f"{weights} weights", rel)
    agree = float((got.argmax(axis=1) == want.argmax(axis=1)).mean())
    assert agree >= 0.9


# ---------------------------------------------------------------------------- the view


def test_view_holds_the_config_and_the_converted_tensors(tiny: Tiny, tmp_path: Path) -> None:
    tm = tiny("smear")
    view = build_view(tm.config, tm.tensors, path=tm.path, weights="q8_0",
                      metadata={"tokenizer.ggml.model": "gpt2"})
    assert view.architecture == "nanochat" and view.get("tokenizer.ggml.model") == "gpt2"
    assert config_from_view(view) == tm.config
    assert view.arch_get("block_count") == tm.config.n_layer
    t = view.tensors
    # padded rows cut off, matrices and tables q8_0, the vectors f32
    assert tm.tensors["transformer.wte.weight"].shape[0] == 320
    assert t["token_embd.weight"].shape == (300, 64) and t["token_embd.weight"].ggml_type == 8
    assert t["blk.1.value_embd.weight"].shape == (300, 32)
    assert t["blk.1.attn_ve_gate.weight"].ggml_type == 0
    assert t["resid_lambdas"].ggml_type == 0 and t["smear_gate.weight"].shape == (24,)
    assert "blk.0.value_embd.weight" not in t  # layers 1 and 3 of 4
    # nanochat's rotation by -theta: the second half of every q head negated
    wq = tm.tensors["transformer.h.0.attn.c_q.weight"]
    f32 = build_view(tm.config, tm.tensors, path=tm.path).tensors["blk.0.attn_q.weight"]
    got = f32.data.view(np.float32).reshape(4, 16, 64)
    np.testing.assert_array_equal(got[:, :8], wq.reshape(4, 16, 64)[:, :8])
    np.testing.assert_array_equal(got[:, 8:], -wq.reshape(4, 16, 64)[:, 8:])
    with pytest.raises(ValueError, match="weights must be one of"):
        build_view(tm.config, tm.tensors, path=tm.path, weights="q4_0")


def test_view_refuses_a_checkpoint_it_cannot_serve(tiny: Tiny) -> None:
    tm = tiny("smear")
    broken = dict(tm.tensors)
    del broken["transformer.h.1.attn.ve_gate.weight"]
    with pytest.raises(ValueError, match="ve_gate"):
        build_view(tm.config, broken, path=tm.path)
    broken = dict(tm.tensors, **{"transformer.h.0.mlp.c_fc.weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(ValueError, match="shape"):
        build_view(tm.config, broken, path=tm.path)
