"""Tiny random transformers ``InklingForCausalLM`` checkpoints for the tests, cached.

A checkpoint is a folder ``config.json`` + ``model.safetensors`` + a small byte-level BPE
tokenizer (trained by ``tokenizers`` on a few sentences with Inkling's split, with its
special tokens), in
the test cache directory (``$LMSERVE_TEST_CACHE``), keyed by its spec and the transformers
version. Every parameter gets noise (the 1-D ones too: norms, global scales, the router
bias), so no conversion transform goes untested.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmserve_core.testing.assets import cache_dir
from lmserve_core.testing.gguf_writer import atomic_output

VERSION = "2"

SPECIAL_TOKENS = [
    "<|content_model_end_sampling|>",
    "<|message_system|>",
    "<|message_user|>",
    "<|message_model|>",
    "<|message_tool|>",
    "<|content_text|>",
    "<|content_thinking|>",
    "<|content_invoke_tool_json|>",
    "<|end_message|>",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Numbers 0123456789 and symbols +-*/=<>()[]{} are tokens too.",
    "Thinking step by step: first read, then answer.",
    "Cafe\u0301 cre\u0300me, hindi \u0939\u093f\u0928\u094d\u0926\u0940, ti\u1ebfng Vi\u1ec7t.",
]
# o200k's split, whose letter classes take combining marks: the family of Inkling's tokenizer
# (a GGUF names it ``inkling``).
SPLIT = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


@dataclass(frozen=True)
class TinyInkling:
    """Geometry of a tiny Inkling: 4 layers (sliding, sliding, global, sliding), the first
    dense, then MoE; a window shorter than the tests' prompts."""

    vocab_size: int = 384
    hidden_size: int = 64
    num_hidden_layers: int = 4
    local_layer_ids: tuple[int, ...] = (0, 1, 3)
    dense_mlp_idx: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    swa_num_key_value_heads: int = 2
    head_dim: int = 16
    sliding_window_size: int = 8
    rel_extent: int = 12
    d_rel: int = 4
    conv_kernel_size: int = 4
    intermediate_size: int = 96
    moe_intermediate_size: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 2
    route_scale: float = 2.5
    logits_mup_width_multiplier: float = 4.0
    log_scaling_n_floor: int | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self, unpadded: int) -> dict[str, Any]:
        d = asdict(self)
        for k in ("seed", "extra"):
            d.pop(k)
        d["local_layer_ids"] = list(self.local_layer_ids)
        d["swa_num_attention_heads"] = self.num_attention_heads
        d["swa_head_dim"] = self.head_dim
        d["unpadded_vocab_size"] = unpadded
        d["max_position_embeddings"] = 4096
        d["rms_norm_eps"] = 1e-6
        d["eos_token_id"] = 0
        d["bos_token_id"] = 0
        return d | self.extra


def _train_tokenizer(size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _write_tokenizer(dest: Path, size: int) -> int:
    tok = _train_tokenizer(size)
    tok.save(str(dest / "tokenizer.json"))
    decoder = {
        str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                  "rstrip": False, "normalized": False, "single_word": False}
        for t in SPECIAL_TOKENS
    }
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder,
        "eos_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))
    return int(tok.get_vocab_size())


def _randomise(model: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * noise)  # norms and global scales
            elif "sconv" in name:
                p.copy_(0.3 * noise)
            elif name.endswith("rel_logits_proj.proj"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))


def tiny_checkpoint(spec: TinyInkling | None = None) -> Path:
    """The cached checkpoint folder of ``spec`` (written on first use)."""
    import torch
    import transformers

    spec = spec or TinyInkling()
    key = json.dumps([VERSION, transformers.__version__, asdict(spec)], sort_keys=True)
    dest = cache_dir() / "inkling" / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (dest / "config.json").is_file():
        return dest
    with atomic_output(dest) as tmp:
        tmp.mkdir(parents=True)
        n_tok = _write_tokenizer(tmp, spec.vocab_size - 40)
        config = transformers.InklingTextConfig(**spec.config(n_tok))
        torch.manual_seed(spec.seed)
        model = transformers.InklingForCausalLM(config).to(torch.float32)
        _randomise(model, spec.seed)
        model.config.architectures = ["InklingForCausalLM"]
        model.save_pretrained(tmp)
    return dest


def load_reference(path: Path) -> Any:
    """The checkpoint as a float32 transformers model, eager attention, eval mode."""
    import torch
    import transformers

    model = transformers.InklingForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
