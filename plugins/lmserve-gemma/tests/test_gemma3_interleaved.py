"""The real Gemma-3-270M (Q4_K_M) with its matrices in the interleaved layouts, the
super-blocks (Q4_K, Q6_K) among them, against the same file in its own layouts. The layouts
are forced on every machine (through the portable products where the ISA has no others)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from lmserve_gemma.model import Gemma3Model

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.native import kernels as K
from lmserve_core.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from models import gemma3_path  # noqa: E402

SUPER_BLOCKS = (int(K.QuantType.Q4_K), int(K.QuantType.Q6_K))
PROMPT = (
    "<start_of_turn>user\nExplain in two sentences why the sky is blue, and then give one "
    "example of Rayleigh scattering that a child could observe at home.<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def test_interleaved_super_blocks_give_the_files_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill on float32 activations decodes the interleaved Q4_K and Q6_K matrices to the
    file's values: the logits of the file's layouts bit for bit. The integer products of
    decode and of int16 prefill give them within their float rounding, and a token's logits do not depend on how many
    rows its pass has."""
    K.select_decode_precision(K.DecodePrecision.I16)
    with GGUFFile.open(gemma3_path()) as gguf:
        ids = Tokenizer.from_gguf(gguf).encode(PROMPT, add_special=True, parse_special=True)
        k_bytes = sum(t.nbytes for t in gguf.tensors.values() if t.ggml_type in SUPER_BLOCKS)
        monkeypatch.setattr(K, "interleaved_for", lambda qtype: None)
        plain = Gemma3Model.load(gguf, n_threads=2, kv_type="f32")
        monkeypatch.setattr(
            K,
            "interleaved_for",
            lambda qtype: None if int(qtype) in SUPER_BLOCKS else K._R16_TYPE.get(int(qtype)),
        )
        blocks32 = Gemma3Model.load(gguf, n_threads=2, kv_type="f32")
        monkeypatch.setattr(K, "interleaved_for", lambda qtype: K._R16_TYPE.get(int(qtype)))
        packed = Gemma3Model.load(gguf, n_threads=2, kv_type="f32")
    assert plain.interleaved_bytes == 0 and k_bytes > 0
    assert packed.interleaved_bytes == blocks32.interleaved_bytes + k_bytes
    blocks32.close()
    n = len(ids)
    assert n >= 32
    with (
        K.use_decode_precision(K.DecodePrecision.F32),
        K.use_prefill_precision(K.PrefillPrecision.F32),
    ):
        want = plain.forward(plain.new_cache(n), ids, 0, all_logits=True)
        np.testing.assert_array_equal(
            packed.forward(packed.new_cache(n), ids, 0, all_logits=True), want
        )
    # int16 prefill (the default) multiplies them as decode does: within the same rounding
    got = packed.forward(packed.new_cache(n), ids, 0, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    steps = ids[n - 7 :]
    caches = {m: m.new_cache(n) for m in (plain, packed)}
    for m, cache in caches.items():
        m.forward(cache, ids[: n - 7], 0)
    one_pass = packed.new_cache(n)
    packed.forward(one_pass, ids[: n - 7], 0)
    rows = packed.forward(one_pass, steps, n - 7, all_logits=True)
    for i, tok in enumerate(steps):  # decoded one at a time
        want = plain.forward(caches[plain], [tok], n - 7 + i)
        got = packed.forward(caches[packed], [tok], n - 7 + i)
        # measured: up to 3.5e-4 of the largest logit, as between the blocks of 32 in
        # either layout; the two sum the same integer products' floats in other orders
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        np.testing.assert_array_equal(rows[i], got)
    for m in (plain, packed):
        m.close()
