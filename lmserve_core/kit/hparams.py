"""Hyper-parameters of a GGUF model, read from its ``{architecture}.*`` metadata with checks.

Every family reads the same kinds of keys (``block_count``, ``attention.head_count``, ...);
:class:`HParams` turns a missing, mistyped or absurd value into a :class:`GGUFError` that
names the key, before any size reaches native code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmserve_core.gguf_file import GGUFError, GGUFFile

__all__ = ["HParams", "MISSING"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

# Upper bounds that no real model comes near; they keep a hostile file from asking native
# code for absurd allocations.
MAX_DIM = 1 << 20
MAX_LAYERS = 4096


class HParams:
    """The metadata of one GGUF under its architecture's prefix."""

    def __init__(self, gguf: GGUFFile, architecture: str | None = None) -> None:
        self.gguf = gguf
        self.arch = architecture or gguf.architecture
        if not self.arch:
            raise GGUFError(f"{gguf.path}: general.architecture is missing")

    @classmethod
    def served(cls, gguf: GGUFFile, architectures: Sequence[str], family: str) -> HParams:
        """The metadata of a file whose architecture is one of ``architectures``; a
        :class:`GGUFError` naming the ``family`` otherwise."""
        if gguf.architecture not in architectures:
            raise GGUFError(
                f"architecture {gguf.architecture!r} is not served by the {family} family"
            )
        return cls(gguf)

    def key(self, suffix: str) -> str:
        """The full key of ``suffix``: ``{arch}.{suffix}``."""
        return f"{self.arch}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.key(suffix) in self.gguf.metadata

    def raw(self, suffix: str, default: Any = MISSING) -> Any:
        """The value as stored, or ``default``; GGUFError when missing without a default."""
        value = self.gguf.metadata.get(self.key(suffix), MISSING)
        if value is MISSING:
            if default is MISSING:
                raise self._error(suffix, "is missing")
            return default
        return value

    def integer(
        self, suffix: str, default: Any = MISSING, *, minimum: int = 1, maximum: int = MAX_DIM
    ) -> int:
        """An integer in ``[minimum, maximum]``."""
        value = self.raw(suffix, default)
        return self._int(suffix, value, minimum, maximum)

    def number(
        self,
        suffix: str,
        default: Any = MISSING,
        *,
        minimum: float = 0.0,
        maximum: float = math.inf,
        inclusive: bool = False,
    ) -> float:
        """A finite number above ``minimum`` (or equal to it with ``inclusive``)."""
        value = self.raw(suffix, default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise self._error(suffix, f"expected a number, got {value!r}") from None
        low_ok = number >= minimum if inclusive else number > minimum
        if not (math.isfinite(number) and low_ok and number <= maximum):
            bound = f">= {minimum}" if inclusive else f"> {minimum}"
            raise self._error(suffix, f"expected a finite number {bound}, got {value!r}")
        return number

    def text(self, suffix: str, default: Any = MISSING) -> str:
        value = self.raw(suffix, default)
        if not isinstance(value, str):
            raise self._error(suffix, f"expected a string, got {value!r}")
        return value

    def flag(self, suffix: str, default: Any = MISSING) -> bool:
        value = self.raw(suffix, default)
        if not isinstance(value, bool | np.bool_) and value not in (0, 1):
            raise self._error(suffix, f"expected a boolean, got {value!r}")
        return bool(value)

    def per_layer(
        self,
        suffix: str,
        n_layer: int,
        default: Any = MISSING,
        *,
        minimum: int = 1,
        maximum: int = MAX_DIM,
    ) -> list[int]:
        """An integer per layer: a scalar applies to every layer, an array gives each its own."""
        value = self.raw(suffix, default)
        if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str):
            items = list(value)
            if len(items) != n_layer:
                raise self._error(suffix, f"has {len(items)} values for {n_layer} layers")
            return [self._int(suffix, v, minimum, maximum) for v in items]
        return [self._int(suffix, value, minimum, maximum)] * n_layer

    def block_count(self) -> int:
        return self.integer("block_count", maximum=MAX_LAYERS)

    def vocab_size(self) -> int:
        """``{arch}.vocab_size``, else the tokenizer's token count, else token_embd's rows."""
        if self.has("vocab_size"):
            return self.integer("vocab_size", maximum=1 << 24)
        tokens = self.gguf.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None:
            return self._int("vocab_size", len(tokens), 1, 1 << 24)
        embd = self.gguf.tensors.get("token_embd.weight")
        if embd is not None and len(embd.shape) == 2:
            return self._int("vocab_size", embd.shape[0], 1, 1 << 24)
        raise GGUFError(f"{self.gguf.path}: cannot tell the vocabulary size")

    # ------------------------------------------------------------------ helpers

    def _int(self, suffix: str, value: Any, minimum: int, maximum: int) -> int:
        if isinstance(value, bool | np.bool_):
            raise self._error(suffix, f"expected an integer, got {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            raise self._error(suffix, f"expected an integer, got {value!r}") from None
        if number != value:
            raise self._error(suffix, f"expected an integer, got {value!r}")
        if not minimum <= number <= maximum:
            raise self._error(suffix, f"{number} is outside [{minimum}, {maximum}]")
        return number

    def _error(self, suffix: str, what: str) -> GGUFError:
        return GGUFError(f"{self.gguf.path}: metadata {self.key(suffix)} {what}")
