"""The torch copy of a GGUF model that a cartridge is trained through: prefill K/V in the
file's key order, teacher logits, and the trainable prefix rows (see :mod:`.train`)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .file import Cartridge

# transformers' GGUF loader reverse-permutes attn_q / attn_k of these architectures (its
# half-split rotation against llama.cpp's adjacent pairs); their cartridge keys are permuted
# back to the file's order.
PERMUTED_ARCHITECTURES = frozenset({"llama"})


def key_order(head_dim: int) -> np.ndarray:
    """Index map from transformers' half-split key order to the file's adjacent-pair order:
    ``file = hf[..., key_order(d)]`` (pair i of the file is (i, i + d/2) of transformers)."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


class TorchLM:
    """A frozen transformers causal LM and the cartridge plumbing around it: prefill K/V,
    logits behind a prefix, greedy decode behind a prefix, last hidden state."""

    def __init__(self, hf: Any, *, permuted: bool) -> None:
        import torch

        self.torch = torch
        self.hf = hf.eval()
        for w in self.hf.parameters():
            w.requires_grad_(False)
        cfg = hf.config.get_text_config(decoder=True)
        self.config = cfg
        self.n_layer = int(cfg.num_hidden_layers)
        self.n_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.permuted = permuted
        # the cache argument's name: `cache` in recent transformers, `past_key_values` before
        params = inspect.signature(type(self.hf).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        order = key_order(self.head_dim)
        self._to_file = torch.as_tensor(order)
        self._from_file = torch.as_tensor(np.argsort(order))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], architecture: str) -> TorchLM:
        """The GGUF's weights dequantised to float32 by transformers' GGUF loader."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        path = Path(path)
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
        return cls(hf, permuted=architecture in PERMUTED_ARCHITECTURES)

    def _cache(self, prefix: tuple[Any, Any] | None, *, batched: bool = False) -> Any:
        """A transformers cache holding ``prefix`` (``[n_layer, (batch,) n_kv_heads, p,
        head_dim]``)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config)
        if prefix is not None:
            k, v = prefix
            for i in range(self.n_layer):
                ki, vi = (k[i], v[i]) if batched else (k[i].unsqueeze(0), v[i].unsqueeze(0))
                cache.update(ki, vi, i)
        return cache

    def prefill(self, ids: Sequence[int]) -> tuple[Any, Any]:
        """K and V of ``ids`` at positions 0.., as ``[n_layer, n_kv_heads, n, head_dim]``
        in transformers' key order."""
        torch = self.torch
        with torch.no_grad():
            cache = self._cache(None)
            self.hf(input_ids=torch.tensor([list(ids)]), use_cache=True, **{self._cache_arg: cache})
            k = torch.stack([cache.layers[i].keys[0] for i in range(self.n_layer)])
            v = torch.stack([cache.layers[i].values[0] for i in range(self.n_layer)])
        return k.contiguous(), v.contiguous()

    def logits(self, ids: Sequence[int], prefix: tuple[Any, Any] | None = None) -> Any:
        """Logits ``[len(ids), vocab]`` of ``ids`` behind ``prefix`` (positions start at its
        length); differentiable in the prefix."""
        torch = self.torch
        out = self.hf(
            input_ids=torch.tensor([list(ids)]),
            use_cache=True,
            **{self._cache_arg: self._cache(prefix)},
        )
        return out.logits[0]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prefix: tuple[Any, Any] | None,
        max_new: int,
        stop: frozenset[int] | set[int],
    ) -> list[list[int]]:
        """Greedy tokens after each of ``prompts`` behind ``prefix`` (stop token excluded),
        the prompts decoded together (left-padded; positions and mask per row)."""
        torch = self.torch
        n = len(prompts)
        if n == 0:
            return []
        width = max(len(q) for q in prompts)
        p = 0 if prefix is None else int(prefix[0].shape[2])
        ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, p + width), dtype=torch.long)
        mask[:, :p] = 1
        for r, q in enumerate(prompts):
            ids[r, width - len(q) :] = torch.tensor(list(q))
            mask[r, p + width - len(q) :] = 1
        pos = (mask[:, p:].cumsum(-1) - 1).clamp(min=0) + p
        batch_prefix = None
        if prefix is not None:
            k, v = prefix
            batch_prefix = (
                k.unsqueeze(1).expand(-1, n, -1, -1, -1),
                v.unsqueeze(1).expand(-1, n, -1, -1, -1),
            )
        out: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        with torch.no_grad():
            cache = self._cache(batch_prefix, batched=True)
            for _ in range(max_new):
                logits = self.hf(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    use_cache=True,
                    **{self._cache_arg: cache},
                ).logits[:, -1]
                nxt = logits.argmax(-1)
                for r in range(n):
                    tok = int(nxt[r])
                    if done[r] or tok in stop:
                        done[r] = True
                    else:
                        out[r].append(tok)
                if all(done):
                    break
                ids = nxt.unsqueeze(1)
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
                pos = pos[:, -1:] + 1
        return out

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The final-norm hidden state of the last of ``ids`` (float32)."""
        torch = self.torch
        with torch.no_grad():
            base = self.hf.get_decoder() if hasattr(self.hf, "get_decoder") else self.hf.model
            h = base(input_ids=torch.tensor([list(ids)])).last_hidden_state[0, -1]
        return h.float().numpy().copy()

    # the file's layout: per layer [p, n_kv_heads, head_dim], keys in the file's order
    def to_cartridge(self, k: Any, v: Any, metadata: dict[str, str]) -> Cartridge:
        torch = self.torch
        with torch.no_grad():
            kk = k.detach()
            if self.permuted:
                kk = kk.index_select(-1, self._to_file)
            ks = [
                kk[i].transpose(0, 1).contiguous().numpy().astype(np.float32)
                for i in range(self.n_layer)
            ]
            vs = [
                v.detach()[i].transpose(0, 1).contiguous().numpy().astype(np.float32)
                for i in range(self.n_layer)
            ]
        return Cartridge(k=ks, v=vs, metadata=dict(metadata), frozen_prefix=1)

    def from_cartridge(self, cart: Cartridge) -> tuple[Any, Any]:
        torch = self.torch
        k = torch.stack(
            [torch.from_numpy(np.asarray(a, np.float32)).transpose(0, 1) for a in cart.k]
        )
        v = torch.stack(
            [torch.from_numpy(np.asarray(a, np.float32)).transpose(0, 1) for a in cart.v]
        )
        if self.permuted:
            k = k.index_select(-1, self._from_file)
        return k.contiguous(), v.contiguous()


class Prefix:
    """The trainable prefix: a frozen sink row and ``p - 1`` leaf rows per layer (K and V,
    ``[n_layer, n_kv_heads, rows, head_dim]``)."""

    def __init__(self, k: Any, v: Any) -> None:
        self.sink_k = k[:, :, :1].detach().clone()
        self.sink_v = v[:, :, :1].detach().clone()
        self.k = k[:, :, 1:].detach().clone().requires_grad_(True)
        self.v = v[:, :, 1:].detach().clone().requires_grad_(True)

    @property
    def p(self) -> int:
        return int(self.k.shape[2]) + 1

    def full(self) -> tuple[Any, Any]:
        import torch

        return torch.cat([self.sink_k, self.k], dim=2), torch.cat([self.sink_v, self.v], dim=2)

    def params(self) -> list[Any]:
        return [self.k, self.v]
