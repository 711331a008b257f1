"""nanochat's vocabulary, from any of the files that carry it, as lmserve's byte-level BPE.

nanochat trains a byte-level BPE with rustbpe and encodes with tiktoken: a ``tiktoken``
``Encoding`` whose ordinary tokens are byte strings ranked 0..n-1 (the rank is the id, the
256 single bytes first), and nine special tokens after them (``<|bos|>`` ...). Three files
carry it:

- ``tokenizer/tokenizer.pkl``, nanochat's own: the pickled ``Encoding``. tiktoken pickles
  it as ``tiktoken.core.Encoding`` rebuilt from a state dict (``name``, ``pat_str``,
  ``mergeable_ranks``, ``special_tokens``); :func:`read_tokenizer_pkl` unpickles it with an
  unpickler that knows that one global, as a class capturing the state, and nothing else
  (neither tiktoken nor any other code of the file runs).
- ``tokenizer.bin`` (``NCTOKz01``, fucina's export): the 256 bytes, the merges in rank order
  (merge i makes token 256 + i) and the special tokens, ids ``256 + n_merges + k``.
- ``tokenizer.json``, the Hugging Face port's: a byte-level BPE of the ``tokenizers``
  library, with the special tokens as added tokens.

:class:`Vocab` holds the tokens as bytes by id and the merges as pairs of ids in priority
order. tiktoken has no merges; they are derived from the ranks as llama.cpp's converter does
for tiktoken vocabularies: a token of rank r is the two parts that byte-pair encoding its
bytes with the ranks below r ends with. lmserve's :class:`~lmserve_core.tokenizer.Tokenizer`
then runs the ``tokenizers`` library's BPE over GPT-2's byte characters after the
``nanochat`` pre-tokenizer (nanochat's ``SPLIT_PATTERN``), with tiktoken's rule that a piece
which is a token is that token (``ignore_merges``).
"""

from __future__ import annotations

import io
import json
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve_core.tokenizer import Tokenizer, TokenType, _bytes_to_unicode

from .config import CheckpointError

# nanochat/tokenizer.py
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
PRE_TOKENIZER = "nanochat"  # lmserve_core.tokenizer's name for SPLIT_PATTERN
TOKENIZER_BIN_MAGIC = b"NCTOKz01"
MAX_TOKENIZER_BYTES = 256 << 20

_BYTE_CHARS = _bytes_to_unicode()
_CHAR_BYTES = {c: b for b, c in _BYTE_CHARS.items()}


def byte_text(piece: bytes) -> str:
    """A token's bytes as GPT-2's byte characters (the text a byte-level BPE stores)."""
    return "".join(_BYTE_CHARS[b] for b in piece)


@dataclass(frozen=True, eq=False)
class Vocab:
    """A nanochat vocabulary: ordinary tokens (bytes) by id, merges, special tokens."""

    pieces: tuple[bytes, ...]  # ids 0..len-1
    merges: tuple[tuple[int, int], ...]  # (left id, right id), highest priority first
    specials: Mapping[str, int]  # ids from len(pieces) on
    source: Path

    def __post_init__(self) -> None:
        where = self.source
        n = len(self.pieces)
        if len(set(self.pieces)) != n:
            raise CheckpointError(f"{where}: two tokens have the same bytes")
        missing = set(range(256)) - {p[0] for p in self.pieces if len(p) == 1}
        if missing:
            raise CheckpointError(f"{where}: no token for the byte {min(missing):#04x}")
        ids = sorted(self.specials.values())
        if ids != list(range(n, n + len(ids))):
            raise CheckpointError(
                f"{where}: the special tokens' ids {ids} do not follow the {n} ordinary tokens"
            )
        absent = [t for t in SPECIAL_TOKENS if t not in self.specials]
        if absent:
            raise CheckpointError(f"{where}: no special token {', '.join(absent)}")
        for left, right in self.merges:
            if not (0 <= left < n and 0 <= right < n):
                raise CheckpointError(f"{where}: a merge of ids {left}, {right} out of range")

    @property
    def size(self) -> int:
        return len(self.pieces) + len(self.specials)

    @property
    def bos_id(self) -> int:
        return self.specials["<|bos|>"]

    def special(self, text: str) -> int:
        return self.specials[text]

    def texts(self) -> list[str]:
        """Every token's text by id: byte characters, then the special tokens as written."""
        out = [byte_text(p) for p in self.pieces]
        out.extend(sorted(self.specials, key=self.specials.__getitem__))
        return out

    def token_types(self) -> list[int]:
        return [TokenType.NORMAL] * len(self.pieces) + [TokenType.CONTROL] * len(self.specials)

    def merge_lines(self) -> list[str]:
        texts = [byte_text(p) for p in self.pieces]
        return [f"{texts[a]} {texts[b]}" for a, b in self.merges]

    def gguf_metadata(self) -> dict[str, Any]:
        """The ``tokenizer.ggml.*`` keys of a GGUF file holding this vocabulary.

        BOS and EOS are ``<|bos|>`` (it separates documents, as GPT-2's end-of-text does),
        end-of-turn is ``<|assistant_end|>``: nanochat's engine stops at either. No BOS is
        added by encoding: nanochat's chat rendering writes it."""
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": PRE_TOKENIZER,
            "tokenizer.ggml.tokens": self.texts(),
            "tokenizer.ggml.token_type": self.token_types(),
            "tokenizer.ggml.merges": self.merge_lines(),
            "tokenizer.ggml.bos_token_id": self.bos_id,
            "tokenizer.ggml.eos_token_id": self.bos_id,
            "tokenizer.ggml.eot_token_id": self.specials["<|assistant_end|>"],
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.ggml.add_eos_token": False,
        }

    def tokenizer(self) -> Tokenizer:
        """lmserve's tokenizer of this vocabulary (what the GGUF metadata describes)."""
        meta = self.gguf_metadata()
        return Tokenizer(
            model=meta["tokenizer.ggml.model"],
            tokens=meta["tokenizer.ggml.tokens"],
            token_types=meta["tokenizer.ggml.token_type"],
            merges=meta["tokenizer.ggml.merges"],
            pre=meta["tokenizer.ggml.pre"],
            bos_id=meta["tokenizer.ggml.bos_token_id"],
            eos_id=meta["tokenizer.ggml.eos_token_id"],
            eot_id=meta["tokenizer.ggml.eot_token_id"],
            add_bos=meta["tokenizer.ggml.add_bos_token"],
            add_eos=meta["tokenizer.ggml.add_eos_token"],
        )


def read_vocab(path: str | Path) -> Vocab:
    """The vocabulary of ``tokenizer.pkl``, ``tokenizer.bin`` or ``tokenizer.json`` (by the
    file's suffix)."""
    path = Path(path)
    readers = {".pkl": read_tokenizer_pkl, ".bin": read_tokenizer_bin, ".json": read_tokenizer_json}
    reader = readers.get(path.suffix)
    if reader is None:
        raise CheckpointError(f"{path}: not a tokenizer.pkl, tokenizer.bin or tokenizer.json")
    return reader(path)


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    if len(data) > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{path}: over {MAX_TOKENIZER_BYTES >> 20} MiB")
    return data


def _check_pattern(path: Path, pattern: str | None) -> None:
    if pattern != SPLIT_PATTERN:
        raise CheckpointError(
            f"{path}: splits text with {pattern!r}, not nanochat's SPLIT_PATTERN "
            f"({SPLIT_PATTERN!r}): its tokens would not be nanochat's"
        )


# -- tokenizer.pkl ----------------------------------------------------------------------------


class _EncodingState:
    """What ``tiktoken.core.Encoding`` unpickles as here: the state it would be built from."""

    state: dict[str, Any] | None = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, str):
            raise CheckpointError(
                f"is tiktoken's registered encoding {state!r} by name, not a trained one"
            )
        self.state = state


class _PklUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise CheckpointError(
            f"refers to {module}.{name}, which a tiktoken Encoding does not use "
            "(refused: unpickling it could run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("has a persistent id, which a tiktoken Encoding does not use")


def read_tokenizer_pkl(path: str | Path) -> Vocab:
    """nanochat's ``tokenizer.pkl``: a pickled ``tiktoken.Encoding`` (module docstring)."""
    path = Path(path)
    try:
        obj = _PklUnpickler(io.BytesIO(_read(path))).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{path}: nests too deeply") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable pickle ({exc})") from None
    state = obj.state if isinstance(obj, _EncodingState) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a tiktoken Encoding")
    ranks = state.get("mergeable_ranks")
    specials = state.get("special_tokens")
    if not isinstance(ranks, dict) or not all(
        isinstance(k, bytes) and type(v) is int for k, v in ranks.items()
    ):
        raise CheckpointError(f"{path}: mergeable_ranks is not a dict of bytes to ids")
    if not isinstance(specials, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in specials.items()
    ):
        raise CheckpointError(f"{path}: special_tokens is not a dict of strings to ids")
    _check_pattern(path, state.get("pat_str"))
    pieces = [b""] * len(ranks)
    for piece, rank in ranks.items():
        if not 0 <= rank < len(ranks) or pieces[rank]:
            raise CheckpointError(f"{path}: the ranks are not 0..{len(ranks) - 1}")
        pieces[rank] = piece
    return Vocab(tuple(pieces), tuple(derive_merges(pieces, ranks, path)), specials, path)


def derive_merges(
    pieces: list[bytes], ranks: Mapping[bytes, int], where: Path
) -> list[tuple[int, int]]:
    """The merge making each token of two or more bytes, in rank order: the two parts that
    byte-pair encoding its bytes with the ranks below its own ends with (llama.cpp's
    converter for tiktoken vocabularies). Where only one split of the token into two
    lower-ranked tokens exists, that is the one."""
    merges: list[tuple[int, int]] = []
    for rank, piece in enumerate(pieces):
        if len(piece) < 2:
            continue
        splits = []
        for i in range(1, len(piece)):
            left, right = ranks.get(piece[:i]), ranks.get(piece[i:])
            if left is not None and right is not None and left < rank and right < rank:
                splits.append((left, right))
        if len(splits) != 1:
            parts = _bpe(piece, ranks, rank)
            if len(parts) != 2:
                raise CheckpointError(
                    f"{where}: the token of rank {rank} ({piece!r}) is not the merge of two "
                    "tokens of lower rank"
                )
            splits = [(ranks[parts[0]], ranks[parts[1]])]
        merges.append(splits[0])
    return merges


def _bpe(piece: bytes, ranks: Mapping[bytes, int], below: int) -> list[bytes]:
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, at = below, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


# -- tokenizer.bin ----------------------------------------------------------------------------


def read_tokenizer_bin(path: str | Path) -> Vocab:
    """fucina's ``tokenizer.bin`` (``NCTOKz01``, its FORMATS.md): little-endian
    ``magic, u32 version = 1, u32 n_vocab, u32 n_merges, u32 n_special``, then ``n_merges``
    times ``u32 left, u32 right`` (merge i makes token 256 + i), then ``n_special`` times
    ``u32 id, u16 length, utf-8 bytes``; ``256 + n_merges + n_special == n_vocab``."""
    path = Path(path)
    data = _read(path)
    if data[:8] != TOKENIZER_BIN_MAGIC:
        raise CheckpointError(f"{path}: no {TOKENIZER_BIN_MAGIC.decode()} magic")
    try:
        version, n_vocab, n_merges, n_special = struct.unpack_from("<4I", data, 8)
        if version != 1:
            raise CheckpointError(f"{path}: version {version}, only 1 is read")
        if 256 + n_merges + n_special != n_vocab:
            raise CheckpointError(
                f"{path}: 256 + {n_merges} merges + {n_special} special tokens != n_vocab {n_vocab}"
            )
        at = 24
        pairs = struct.unpack_from(f"<{2 * n_merges}I", data, at)
        at += 8 * n_merges
        pieces = [bytes([b]) for b in range(256)]
        merges = []
        for i in range(n_merges):
            left, right = pairs[2 * i], pairs[2 * i + 1]
            if left >= 256 + i or right >= 256 + i:
                raise CheckpointError(f"{path}: merge {i} uses a later token ({left}, {right})")
            pieces.append(pieces[left] + pieces[right])
            merges.append((left, right))
        specials: dict[str, int] = {}
        for k in range(n_special):
            sid, length = struct.unpack_from("<IH", data, at)
            at += 6
            raw = data[at : at + length]
            if len(raw) != length:
                raise struct.error("truncated")
            at += length
            if sid != 256 + n_merges + k:
                raise CheckpointError(f"{path}: special token {k} has id {sid}")
            specials[raw.decode("utf-8")] = sid
    except struct.error:
        raise CheckpointError(f"{path}: truncated") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: a special token that is not UTF-8") from None
    if at != len(data):
        raise CheckpointError(f"{path}: {len(data) - at} bytes after the special tokens")
    return Vocab(tuple(pieces), tuple(merges), specials, path)


# -- tokenizer.json ---------------------------------------------------------------------------


def _patterns(node: Any) -> list[str]:
    """The regexes of a tokenizer.json pre-tokenizer (Split steps, in a Sequence or not)."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [p for step in node.get("pretokenizers") or [] for p in _patterns(step)]
    if node.get("type") == "Split" and isinstance(node.get("pattern"), dict):
        regex = node["pattern"].get("Regex")
        return [regex] if isinstance(regex, str) else []
    return []


def read_tokenizer_json(path: str | Path) -> Vocab:
    """The Hugging Face port's ``tokenizer.json``: a byte-level BPE split by nanochat's
    pattern, with the special tokens as added tokens."""
    path = Path(path)
    try:
        doc = json.loads(_read(path))
    except ValueError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise CheckpointError(f"{path}: not a BPE tokenizer (model.type)")
    vocab, merge_list = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merge_list, list):
        raise CheckpointError(f"{path}: model.vocab or model.merges is missing")
    patterns = _patterns(doc.get("pre_tokenizer"))
    _check_pattern(path, patterns[0] if len(patterns) == 1 else None)
    specials: dict[str, Any] = {}  # their ids are checked below
    for added in doc.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str):
            specials[added["content"]] = added.get("id")
    n = len([t for t in vocab if t not in specials])
    pieces: list[bytes | None] = [None] * n
    for text, tid in vocab.items():
        if text in specials:
            continue
        if type(tid) is not int or not 0 <= tid < n or pieces[tid] is not None:
            raise CheckpointError(f"{path}: the ordinary tokens' ids are not 0..{n - 1}")
        try:
            pieces[tid] = bytes(_CHAR_BYTES[c] for c in text)
        except KeyError:
            raise CheckpointError(f"{path}: the token {text!r} is not byte-level") from None
    merges = []
    for line in merge_list:
        pair = line.split(" ") if isinstance(line, str) else line
        if not isinstance(pair, list) or len(pair) != 2 or not all(p in vocab for p in pair):
            raise CheckpointError(f"{path}: the merge {line!r} is not of two tokens")
        merges.append((vocab[pair[0]], vocab[pair[1]]))
    if any(type(v) is not int for v in specials.values()):
        raise CheckpointError(f"{path}: an added token without an integer id")
    return Vocab(tuple(p or b"" for p in pieces), tuple(merges), specials, path)
