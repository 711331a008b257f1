"""Write GGUF tokenizer metadata from Hugging Face tokenizer files, and encode tensors.

The tokenizer keys follow llama.cpp's ``convert_hf_to_gguf.py`` for byte-level BPE
vocabularies (``tokenizer.ggml.model = "gpt2"``): the token list padded to the model's
vocabulary size with ``[PAD{i}]`` entries, token types (added tokens that are special, or
look special, are CONTROL; other added tokens USER_DEFINED; padding UNUSED), the merges,
the special token ids, ``add_bos_token``/``add_eos_token`` and the chat template.

:func:`encode_tensor` stores an f32 array as F32, F16, BF16, Q8_0 (and the other types the
``gguf`` package encodes) or a K-quant, and returns the f32 values the file really holds, so
a reference computation can use exactly the stored weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

from lmserve_core.testing import kquants
from lmserve_core.testing.assets import TOKENIZERS, cache_dir, tokenizer_dir

T = GGMLQuantizationType

# Bump when the bytes this module (or synthetic.py, which writes with it) writes change: it
# keys the caches built on it.
WRITER_VERSION = "2"


# ------------------------------------------------------------------ atomic outputs


@contextmanager
def atomic_output(dest: Path) -> Iterator[Path]:
    """Yield a fresh path next to ``dest`` to write (a file or a directory), then rename it.

    Two processes building the same output both finish; the second rename of a directory
    loses quietly (the winner's copy is identical), a file is replaced atomically.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    tmp = tmp_root / dest.name
    try:
        yield tmp
        if tmp.is_dir():
            try:
                tmp.rename(dest)
            except OSError:
                if not dest.is_dir():
                    raise
        else:
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


# ------------------------------------------------------------------ tokenizer metadata

# Added tokens that some models fail to mark special but llama.cpp's converter makes CONTROL.
_SPECIAL_LOOKING = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


def looks_special(text: str) -> bool:
    """llama.cpp's does_token_look_special."""
    return (
        text in _SPECIAL_LOOKING
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


@dataclass
class BPEVocab:
    """What a GGUF carries of a byte-level BPE tokenizer."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # "bos", "eos", "pad", ...
    add_special: dict[str, bool] = field(default_factory=dict)  # "bos", "eos", ...
    chat_template: str | None = None


def _round_trip(hf_tokenizer: Any, text: str) -> str:
    ids = hf_tokenizer.encode(text, add_special_tokens=False).ids
    return str(hf_tokenizer.decode(ids, skip_special_tokens=False))


def load_bpe_vocab(
    path: Path, vocab_size: int | None = None, config_ids: Mapping[str, int] | None = None
) -> BPEVocab:
    """Read ``path``'s tokenizer.json + tokenizer_config.json as llama.cpp's converter does.

    ``vocab_size`` pads the token list (the model's embedding rows; default: no padding).
    ``config_ids`` are the ``{bos,eos,pad,...}_token_id`` of the model's ``config.json``,
    used where the tokenizer files name no such token (Qwen3 names no BOS token there).
    """
    import tokenizers
    from gguf.vocab import SpecialVocab

    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: not a BPE tokenizer ({model.get('type')!r})")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added: dict[int, dict[str, Any]] = {}
    for entry in data.get("added_tokens", []):
        by_id[entry["id"]] = entry["content"]
        added[entry["id"]] = entry
    n_vocab = vocab_size if vocab_size is not None else max(by_id) + 1
    if max(by_id) >= n_vocab:
        raise ValueError(f"{path}: token id {max(by_id)} does not fit a vocabulary of {n_vocab}")

    hf = None
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            if not added[i].get("normalized", False):
                # llama.cpp takes added tokens as pre-normalized: store what they decode to.
                hf = hf or tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
                text = _round_trip(hf, text)
            if added[i].get("special", False) or looks_special(text):
                types.append(TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(TokenType.USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(TokenType.NORMAL)

    special = SpecialVocab(path, load_merges=True, n_vocab=n_vocab)
    add_special = dict(special.add_special_token)
    post = data.get("post_processor") or {}
    if any(p.get("type") == "ByteLevel" for p in post.get("processors", [post])):
        # A ByteLevel post-processor adds nothing: llama.cpp's converter (newer than the
        # gguf package's SpecialVocab) then writes add_bos/add_eos False unless set.
        add_special.setdefault("bos", False)
        add_special.setdefault("eos", False)
    ids = dict(special.special_token_ids)
    for kind, tid in (config_ids or {}).items():
        if kind not in ids and 0 <= tid < n_vocab:
            ids[kind] = tid
    template = special.chat_template
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: only a single chat template is supported")
    return BPEVocab(
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=list(special.merges),
        special_ids=ids,
        add_special=add_special,
        chat_template=template,
    )


def add_bpe_tokenizer(writer: GGUFWriter, vocab: BPEVocab, pre: str) -> None:
    """Write ``tokenizer.ggml.*`` and ``tokenizer.chat_template`` for ``vocab``."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    for kind, tid in vocab.special_ids.items():
        add = getattr(writer, f"add_{kind}_token_id", None)
        if add is not None:
            add(tid)
    for kind, value in vocab.add_special.items():
        add = getattr(writer, f"add_add_{kind}_token", None)
        if add is not None:
            add(value)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


@dataclass(frozen=True)
class VocabFamily:
    """How a model family's GGUF files carry its tokenizer."""

    tokenizer: str  # key of assets.TOKENIZERS
    arch: str
    pre: str
    vocab_size: int  # embedding rows of the family's models
    config_ids: Mapping[str, int]  # ids from the models' config.json


FAMILIES: dict[str, VocabFamily] = {
    # Qwen3-0.6B's config.json: bos_token_id 151643, eos_token_id 151645, vocab_size 151936.
    "qwen3": VocabFamily("qwen3", "qwen3", "qwen2", 151936, {"bos": 151643, "eos": 151645}),
}


def family_vocab(family: str) -> BPEVocab:
    spec = FAMILIES[family]
    return load_bpe_vocab(tokenizer_dir(spec.tokenizer), spec.vocab_size, spec.config_ids)


def write_vocab_only(
    path: Path, arch: str, name: str, add_tokenizer: Callable[[GGUFWriter], None]
) -> Path:
    """A GGUF with no tensors (llama.cpp's --vocab-only kind): the architecture, type and
    name, and what ``add_tokenizer`` writes."""
    writer = GGUFWriter(str(path), arch)
    writer.add_type("vocab")
    writer.add_name(name)
    add_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def write_vocab_gguf(path: Path, family: str) -> Path:
    """A GGUF with the ``family`` tokenizer and no tensors (llama.cpp's --vocab-only kind)."""
    spec = FAMILIES[family]
    vocab = family_vocab(family)
    return write_vocab_only(
        path, spec.arch, f"{family} vocabulary", lambda w: add_bpe_tokenizer(w, vocab, spec.pre)
    )


def vocab_gguf(family: str) -> Path:
    """The cached vocabulary-only GGUF of ``family`` (written on first use)."""
    spec = FAMILIES[family]
    package = TOKENIZERS[spec.tokenizer]
    key = hashlib.sha256(repr((WRITER_VERSION, package, spec)).encode()).hexdigest()[:12]
    dest = cache_dir() / "vocab" / f"{family}-vocab-{key}.gguf"
    if not dest.is_file():
        with atomic_output(dest) as tmp:
            write_vocab_gguf(tmp, family)
    return dest


# ------------------------------------------------------------------ tensors

TYPE_NAMES: dict[str, T] = {
    "f32": T.F32,
    "f16": T.F16,
    "bf16": T.BF16,
    "q8_0": T.Q8_0,
    "q5_0": T.Q5_0,
    "q5_1": T.Q5_1,
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q4_k": T.Q4_K,
    "q5_k": T.Q5_K,
    "q6_k": T.Q6_K,
}


def add_arch_metadata(writer: GGUFWriter, arch: str, keys: Mapping[str, Any]) -> None:
    """Write ``{arch}.{key}`` for every key (:func:`add_values`)."""
    add_values(writer, {f"{arch}.{key}": value for key, value in keys.items()})


def add_values(writer: GGUFWriter, keys: Mapping[str, Any]) -> None:
    """Write every key: strings, floats (f32), bools, lists (arrays) and integers (u32), the
    types llama.cpp's converter uses for hyper-parameters; numpy values as their Python
    ones."""
    for full, value in keys.items():
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, list | tuple):
            writer.add_array(full, list(value))
        else:
            writer.add_uint32(full, value)


def encode_raw(array: np.ndarray, qtype: T, *, fast: bool = False) -> np.ndarray:
    """The bytes (or f32/f16 values) that store ``array`` as ``qtype``.

    ``fast``: K-quants skip their scale search (for random benchmark weights).
    """
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == T.F32:
        return array
    if qtype == T.F16:
        return array.astype(np.float16)
    encode = kquants.K_QUANTIZERS.get(qtype)
    return encode(array, search=not fast) if encode is not None else quantize(array, qtype)


def decode_raw(raw: np.ndarray, qtype: T, shape: Sequence[int]) -> np.ndarray:
    """The f32 values that ``raw`` (from :func:`encode_raw`) decodes to."""
    if qtype == T.F32:
        return raw.reshape(shape)
    if qtype == T.F16:
        return raw.astype(np.float32).reshape(shape)
    return dequantize(raw, qtype).reshape(shape)


def encode_tensor(
    array: np.ndarray, qtype: T, *, fast: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes to store, the f32 values they decode to) of ``array`` stored as ``qtype``."""
    raw = encode_raw(array, qtype, fast=fast)
    return raw, decode_raw(raw, qtype, array.shape)


def add_tensor(writer: GGUFWriter, name: str, array: np.ndarray, qtype: T) -> np.ndarray:
    """Queue ``name`` in ``writer`` as ``qtype``; returns the f32 values stored."""
    raw, stored = encode_tensor(array, qtype)
    if qtype in (T.F32, T.F16):
        writer.add_tensor(name, raw)
    else:
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    return stored


def tensor_nbytes(shape: Sequence[int], qtype: T) -> int:
    return int(np.prod(quant_shape_to_byte_shape(shape, qtype)))


class StreamingWriter:
    """A GGUF whose tensors are encoded and written one at a time, in declared order.

    Declare every tensor with :meth:`plan` (and metadata on :attr:`writer`), call
    :meth:`begin`, then :meth:`write` each tensor: memory stays at one tensor's size.
    """

    def __init__(self, path: Path, arch: str) -> None:
        self.writer = GGUFWriter(str(path), arch)
        self._planned: list[tuple[str, tuple[int, ...], T]] = []
        self._next = 0

    def plan(self, name: str, shape: Sequence[int], qtype: T) -> None:
        shape = tuple(int(s) for s in shape)
        if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
            raise ValueError(f"{name}: rows of {shape[-1]} do not fit {qtype.name} blocks")
        byte_shape = quant_shape_to_byte_shape(shape, qtype)
        self.writer.add_tensor_info(
            name, byte_shape, np.dtype(np.uint8), tensor_nbytes(shape, qtype), raw_dtype=qtype
        )
        self._planned.append((name, shape, qtype))

    def begin(self) -> None:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()

    def write(
        self, name: str, array: np.ndarray, *, dequantized: bool = False, fast: bool = False
    ) -> np.ndarray | None:
        """Encode and write the next planned tensor; its stored f32 values if ``dequantized``."""
        want, shape, qtype = self._planned[self._next]
        if name != want or tuple(array.shape) != shape:
            raise ValueError(f"expected {want} {shape}, got {name} {tuple(array.shape)}")
        raw = encode_raw(array, qtype, fast=fast)
        self.writer.write_tensor_data(raw.view(np.uint8))
        self._next += 1
        return decode_raw(raw, qtype, shape) if dequantized else None

    def write_raw(self, name: str, raw: np.ndarray) -> None:
        """Write the next planned tensor from already-encoded bytes."""
        want, shape, qtype = self._planned[self._next]
        if name != want or raw.nbytes != tensor_nbytes(shape, qtype):
            raise ValueError(f"expected {want} ({tensor_nbytes(shape, qtype)} bytes), got {name}")
        self.writer.write_tensor_data(np.ascontiguousarray(raw).view(np.uint8))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._planned):
            missing = [name for name, _, _ in self._planned[self._next :]]
            raise ValueError(f"tensors never written: {missing[:5]}")
        self.writer.close()
