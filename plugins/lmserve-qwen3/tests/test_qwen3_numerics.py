"""Numerical fidelity of Qwen3 and Qwen3-MoE against transformers' own float32 modules.

No real Qwen3 weights can be had here, so the models are synthetic (``synthetic.py``): a
random-initialised ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` with the real Qwen3
vocabulary, written as GGUF in several encodings, and the transformers model holding exactly
the weights each GGUF stores (decoded). The logits of these models spread over about +-12
(std 2), so the bounds below are not met by accident.

Two cache precisions, two references:

- f32 KV cache against transformers as is: only float32 summation order differs.
- the default f16 KV cache against transformers with its keys (after RoPE) and values
  rounded to half precision exactly where our cache stores them: the same computation up to
  the few elements whose float32 values lie so close to a half-precision rounding boundary
  that summation order picks the other neighbour.

Against transformers *without* that rounding, half-precision KV storage itself moves logits
of this size by about 1e-2 (SmolLM2, logits up to 35: 1.4e-2); llama.cpp's default F16
cache does the same. That figure is measured and bounded too; ``docs/numerics.md`` has them.

Every test needs torch + transformers (marker ``reference``) and npm (the tokenizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lmserve_qwen3.model import Qwen3Model  # noqa: E402
from lmserve_qwen3.plugin import create_backend  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from lmserve_core.testing.conformance import (  # noqa: E402
    FamilyConformance,
    Subject,
    check_routing,
    synthetic_subjects,
)
from lmserve_core.testing.numerics import (  # noqa: E402
    f32_reference_path,  # noqa: F401 (an autouse fixture: f32 activations throughout)
    one_torch_thread,  # noqa: F401 (an autouse fixture: torch on one thread)
)

pytestmark = pytest.mark.reference


TEXT = Path(__file__).resolve().parents[3] / "tests" / "data" / "perplexity" / "text.txt"

# Measured max |ours - reference| over every position of 4 prompts: f32 KV 2e-5 .. 3e-5;
# f16 KV against the rounded reference 6e-4 (dense) .. 1.5e-3 (MoE), the boundary flips. A
# wrong RoPE layout, a missed q/k norm or a wrong expert moves logits by whole units.
LOGIT_ATOL = {"f32": 1e-3, "f16": 5e-3}
# Prefill and decode both read the same rounded cache rows: float32 summation order only.
PREFILL_DECODE_ATOL = 1e-3
# f16 KV against unrounded float32: measured 1.1e-2 (dense) and 1.2e-2 (MoE).
F16_STORAGE_ATOL = 5e-2
KV_TYPES = ["f16", "f32"]

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "def fibonacci(n: int) -> list[int]:\n    out = [0, 1]\n    while len(out) < n:\n",
    "The history of the bicycle begins in the early nineteenth century, when inventors",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nList three prime "
    "numbers.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
]
KINDS = ["qwen3", "qwen3moe"]


@contextlib.contextmanager
def half_precision_kv(model: Any) -> Iterator[None]:
    """Round transformers' keys (after RoPE) and values to f16, as our f16 cache stores them."""
    modules = (modeling_qwen3, modeling_qwen3_moe)
    original = {m: m.apply_rotary_pos_emb for m in modules}

    def rope_then_round(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
        q, k = original[modeling_qwen3](q, k, *args, **kwargs)
        return q, k.half().float()

    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: out.half().float())
        for layer in model.model.layers
    ]
    for m in modules:
        m.apply_rotary_pos_emb = rope_then_round
    try:
        yield
    finally:
        for m in modules:
            m.apply_rotary_pos_emb = original[m]
        for hook in hooks:
            hook.remove()


subject = synthetic_subjects(
    lambda kind, gguf, **options: Qwen3Model.load(gguf, n_threads=2, **options),
    create_backend,
    lambda kind, hf: half_precision_kv(hf),
)


class TestQwen3Conformance(FamilyConformance):
    """The family conformance suite on both architectures."""

    LOGIT_ATOL = LOGIT_ATOL
    PATH_ATOL = PREFILL_DECODE_ATOL
    TYPES = ("f16", "bf16", "q8_0", "q4_k_m")
    PROMPTS = tuple(PROMPTS)

    @pytest.fixture(params=KINDS)
    def kind(self, request: Any) -> str:
        return str(request.param)

    @pytest.fixture
    def subject(self, kind: str, synthetic: Any) -> Subject:
        return subject(synthetic, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_storage_moves_logits_little(kind: str, synthetic: Any) -> None:
    ref = subject(synthetic, kind)
    ids = ref.ids(PROMPTS[0] + PROMPTS[2])
    got, exact = ref.mine(ids, "f16"), ref.theirs(ids, "f32")
    diff = float(np.abs(got - exact).max())
    print(
        f"{kind}: f16 KV vs unrounded float32 max |diff| {diff:.3g}, "
        f"max |logit| {np.abs(exact).max():.1f}"
    )
    assert diff <= F16_STORAGE_ATOL


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_forced_top1_agreement(kind: str, synthetic: Any) -> None:
    ref = subject(synthetic, kind)
    ids = ref.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special=True)[:256]
    assert len(ids) >= 200
    for kv in KV_TYPES:
        got, want = ref.mine(ids, kv), ref.theirs(ids, kv)
        agreement = float((got.argmax(axis=1) == want.argmax(axis=1)).mean())
        print(
            f"{kind} {kv} KV: top-1 agreement over {len(ids)} tokens {agreement:.2%}, "
            f"max |diff| {np.abs(got - want).max():.3g}"
        )
        assert agreement == 1.0


# ---------------------------------------------------------------------------- routing


def test_moe_routing_matches_transformers(synthetic: Any) -> None:
    ref = subject(synthetic, "qwen3moe")
    ids = ref.ids(PROMPTS[0] + PROMPTS[2] + PROMPTS[3])
    gates = [layer.mlp.gate for layer in ref.hf.model.layers]
    routing = check_routing(ref, gates, ids, atol=1e-4)
    np.testing.assert_allclose(routing.weights.sum(axis=2), 1.0, atol=1e-5)
