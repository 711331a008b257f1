"""Finding and reading a nanochat checkpoint in any of the layouts that hold one.

(a) nanochat's own output (``NANOCHAT_BASE_DIR``, ``~/.cache/nanochat`` by default)::

        base_dir/tokenizer/tokenizer.pkl
        base_dir/{base,mid,chatsft,chatrl}_checkpoints/d{N}/model_{step:06d}.pt
                                                       /meta_{step:06d}.json

    Given the base directory, the chat model is preferred: ``chatsft``, then ``chatrl``,
    then ``mid``, then ``base`` (nanochat's chat scripts default to sft), unless ``source``
    ("sft", "rl", "mid", "base") says which. Given a ``*_checkpoints`` directory, its largest
    ``d{N}`` (nanochat's ``find_largest_model``: the highest N, else the newest directory);
    given a ``d{N}`` directory (or one of its ``model_*.pt`` files), that model. The step is
    the latest unless ``step`` says. The tokenizer is ``tokenizer/tokenizer.pkl`` in the
    first directory above the model that has one, unless ``tokenizer`` names a file or a
    directory holding one.
(b) a directory holding ``model.safetensors`` (nanochat's state-dict names) and
    ``tokenizer.bin`` (fucina's export). The geometry comes from a JSON file beside it when
    there is one (``model.config.json``, ``config.json``, ``meta.json``: a nanochat meta with
    ``model_config``, or the model_config keys themselves), else from the shapes: ``n_layer``
    counts the layers, ``n_embd`` is ``wte``'s width, the vocabulary is the tokenizer's; a
    value-embedding gate (``ve_gate``, ``n_kv_head`` rows) gives ``n_kv_head`` and with
    ``c_k`` the head size, else the head size is base_train's default of 128 and
    ``n_kv_head = c_k rows / 128``; ``sequence_len`` 2048 and ``window_pattern`` "L" (full
    context: a model trained with sliding windows differs once a prompt outgrows them).
(c) the Hugging Face port: ``config.json`` (``NanoChatForCausalLM``), ``model.safetensors``
    (``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
    ``model.layers.N.mlp.fc{1,2}``, ``lm_head``: renamed to nanochat's) and
    ``tokenizer.json``.

Tensors come as float32 arrays named as nanochat's ``gpt.py`` names them (``_orig_mod.``
dropped), with ``resid_lambdas`` / ``x0_lambdas`` set to 1 / 0 where the checkpoint predates
them, as nanochat's loader does. Every problem is a :class:`CheckpointError` naming the file
or key at fault.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import CheckpointError, NanochatConfig, from_hf_config, from_model_config
from .pt_reader import read_state_dict
from .vocab import Vocab, read_tokenizer_bin, read_tokenizer_json, read_tokenizer_pkl

SOURCES = {"sft": "chatsft", "rl": "chatrl", "mid": "mid", "base": "base"}  # preference order
HF_ARCHITECTURE = "NanoChatForCausalLM"
DEFAULT_HEAD_DIM = 128  # scripts/base_train.py --head-dim
DEFAULT_SEQUENCE_LEN = 2048  # scripts/base_train.py --max-seq-len
ORIG_MOD = "_orig_mod."  # torch.compile's prefix

_MODEL_PT = re.compile(r"model_(\d+)\.pt")
_KNOWN = re.compile(
    r"transformer\.wte\.weight|lm_head\.weight|resid_lambdas|x0_lambdas|smear_gate\.weight"
    r"|smear_lambda|backout_lambda|value_embeds\.\d+\.weight"
    r"|transformer\.h\.\d+\.(attn\.(c_q|c_k|c_v|c_proj|ve_gate)|mlp\.(c_fc|c_proj))\.weight"
)
_HF_NAMES = (
    (re.compile(r"model\.embed_tokens\.weight"), "transformer.wte.weight"),
    (re.compile(r"lm_head\.weight"), "lm_head.weight"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight"), r"transformer.h.\1.attn.c_q.weight"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight"), r"transformer.h.\1.attn.c_k.weight"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight"), r"transformer.h.\1.attn.c_v.weight"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight"), r"transformer.h.\1.attn.c_proj.weight"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.fc1\.weight"), r"transformer.h.\1.mlp.c_fc.weight"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.fc2\.weight"), r"transformer.h.\1.mlp.c_proj.weight"),
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A nanochat model ready for the forward pass."""

    config: NanochatConfig
    tensors: dict[str, np.ndarray]  # nanochat's names -> float32 (may be read-only views)
    vocab: Vocab
    model_file: Path
    description: str  # one line for logs


# -- recognising ------------------------------------------------------------------------------


def _is_hf(path: Path) -> bool:
    try:
        with open(path / "config.json", "rb") as fh:
            config = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and HF_ARCHITECTURE in (config.get("architectures") or [])


def _steps(model_dir: Path) -> dict[int, Path]:
    try:
        names = os.listdir(model_dir)
    except OSError:
        return {}
    return {int(m[1]): model_dir / n for n in names if (m := _MODEL_PT.fullmatch(n))}


def _model_dirs(checkpoints_dir: Path) -> list[Path]:
    try:
        return [p for p in checkpoints_dir.iterdir() if p.is_dir() and _steps(p)]
    except OSError:
        return []


def looks_like_nanochat(path: str | Path) -> bool:
    """Whether ``path`` is a nanochat checkpoint in a layout :func:`load_checkpoint` reads
    (from the names of the files, and the architecture in a ``config.json``)."""
    path = Path(path)
    if path.is_file():
        return _MODEL_PT.fullmatch(path.name) is not None
    if not path.is_dir():
        return False
    if _is_hf(path):
        return True
    if (path / "model.safetensors").is_file() and (path / "tokenizer.bin").is_file():
        return True
    if _steps(path):
        return True
    if path.name.endswith("_checkpoints") and _model_dirs(path):
        return True
    return any(_model_dirs(path / f"{d}_checkpoints") for d in SOURCES.values())


# -- loading ----------------------------------------------------------------------------------


def load_checkpoint(
    path: str | Path,
    *,
    step: int | None = None,
    tokenizer: str | Path | None = None,
    source: str | None = None,
) -> Checkpoint:
    """The checkpoint at ``path``, in any layout of the module docstring."""
    path = Path(path)
    if source is not None and source not in SOURCES:
        raise CheckpointError(f"source {source!r}: one of {', '.join(SOURCES)}")
    if path.is_file():
        m = _MODEL_PT.fullmatch(path.name)
        if m is None:
            raise CheckpointError(f"{path}: a nanochat checkpoint file is model_<step>.pt")
        if step is not None and step != int(m[1]):
            raise CheckpointError(f"{path}: is step {int(m[1])}, not {step}")
        return _load_native(path.parent, int(m[1]), tokenizer, None)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if _is_hf(path):
        return _load_hf(path, tokenizer)
    if (path / "model.safetensors").is_file():
        return _load_safetensors(path, tokenizer)
    if _steps(path):
        return _load_native(path, step, tokenizer, None)
    if path.name.endswith("_checkpoints"):
        return _load_native(_largest_model(path), step, tokenizer, None)
    candidates = [source] if source else list(SOURCES)
    for name in candidates:
        checkpoints = path / f"{SOURCES[name]}_checkpoints"
        if _model_dirs(checkpoints):
            return _load_native(_largest_model(checkpoints), step, tokenizer, name)
    if source:
        raise CheckpointError(f"{path}: no model in {SOURCES[source]}_checkpoints/d*/")
    raise CheckpointError(
        f"{path}: not a nanochat checkpoint: no model_<step>.pt, no "
        "{base,mid,chatsft,chatrl}_checkpoints/d*/model_<step>.pt, no model.safetensors "
        f"(with tokenizer.bin), no config.json of {HF_ARCHITECTURE}"
    )


def _largest_model(checkpoints: Path) -> Path:
    """nanochat's find_largest_model: the highest d<N>, else the newest directory."""
    dirs = _model_dirs(checkpoints)
    if not dirs:
        raise CheckpointError(f"{checkpoints}: no d<N>/model_<step>.pt in it")
    tagged = [(int(m[1]), d) for d in dirs if (m := re.match(r"d(\d+)", d.name))]
    if tagged:
        return max(tagged, key=lambda t: t[0])[1]
    return max(dirs, key=lambda d: d.stat().st_mtime)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from None


def _find_tokenizer(start: Path, given: str | Path | None, name: str) -> Path:
    """``given`` (a file, or a directory holding ``name`` or ``tokenizer/name``), else
    ``tokenizer/name`` in ``start`` or the first directory above it that has one."""
    if given is not None:
        given = Path(given)
        if given.is_file():
            return given
        for candidate in (given / name, given / "tokenizer" / name):
            if candidate.is_file():
                return candidate
        raise CheckpointError(f"{given}: no {name} (nor tokenizer/{name}) there")
    for directory in (start, *start.resolve().parents):
        candidate = directory / "tokenizer" / name
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"{start}: no tokenizer/{name} in it or any directory above it "
        "(nanochat keeps it in its base directory): say where with tokenizer="
    )


def _vocab(path: Path) -> Vocab:
    readers = {".pkl": read_tokenizer_pkl, ".bin": read_tokenizer_bin}
    return readers.get(path.suffix, read_tokenizer_json)(path)


def _load_native(
    model_dir: Path, step: int | None, tokenizer: str | Path | None, source: str | None
) -> Checkpoint:
    steps = _steps(model_dir)
    if not steps:
        raise CheckpointError(f"{model_dir}: no model_<step>.pt in it")
    if step is None:
        step = max(steps)
    elif step not in steps:
        have = ", ".join(str(s) for s in sorted(steps))
        raise CheckpointError(f"{model_dir}: no model_{step:06d}.pt (steps: {have})")
    model_file = steps[step]
    meta_file = model_dir / f"meta_{step:06d}.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{meta_file}: missing (nanochat writes it beside {model_file.name})")
    meta = _json(meta_file)
    model_config = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(model_config, dict):
        raise CheckpointError(f"{meta_file}: no model_config")
    vocab = read_tokenizer_pkl(_find_tokenizer(model_dir, tokenizer, "tokenizer.pkl"))
    tensors = {k.removeprefix(ORIG_MOD): v for k, v in read_state_dict(model_file).items()}
    config = from_model_config(model_config, _shapes(tensors), str(meta_file))
    kind = f"{source} " if source else ""
    return _finish(
        config, tensors, vocab, model_file, f"nanochat {kind}{model_dir.name} step {step}"
    )


def _shapes(tensors: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _finish(
    config: NanochatConfig,
    tensors: dict[str, np.ndarray],
    vocab: Vocab,
    model_file: Path,
    what: str,
) -> Checkpoint:
    where = model_file
    if config.vocab_size != vocab.size:
        raise CheckpointError(
            f"{where}: the model has a vocabulary of {config.vocab_size}, the tokenizer "
            f"{vocab.source} of {vocab.size}"
        )
    for name, array in tensors.items():
        if not _KNOWN.fullmatch(name):
            raise CheckpointError(f"{where}: unexpected tensor {name} (not of nanochat's gpt.py)")
        if array.dtype != np.float32:
            raise CheckpointError(f"{where}: {name} is {array.dtype}, not floating point")
    _check_shapes(config, tensors, where)
    # nanochat's _patch_missing_keys
    tensors.setdefault("resid_lambdas", np.ones(config.n_layer, np.float32))
    tensors.setdefault("x0_lambdas", np.zeros(config.n_layer, np.float32))
    n_params = sum(int(a.size) for a in tensors.values())
    description = (
        f"{what} ({model_file.name}): {config.n_layer} layers x {config.n_embd}, "
        f"{config.n_head} heads ({config.n_kv_head} kv), vocab {config.vocab_size}, "
        f"{config.generation} gpt.py, {n_params / 1e6:.0f}M parameters"
    )
    return Checkpoint(config, tensors, vocab, model_file, description)


def _check_shapes(config: NanochatConfig, tensors: dict[str, np.ndarray], where: Path) -> None:
    d, kv, ff = config.n_embd, config.kv_dim, config.n_ff
    want: dict[str, tuple[int, int]] = {}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}"
        want |= {
            f"{h}.attn.c_q.weight": (config.n_head * config.head_dim, d),
            f"{h}.attn.c_k.weight": (kv, d),
            f"{h}.attn.c_v.weight": (kv, d),
            f"{h}.attn.c_proj.weight": (d, d),
            f"{h}.mlp.c_fc.weight": (ff, d),
            f"{h}.mlp.c_proj.weight": (d, ff),
        }
    for name, shape in want.items():
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{where}: {name} is {tuple(tensors[name].shape)}, the config makes it {shape}"
            )
    for name in ("transformer.wte.weight", "lm_head.weight"):
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name}")
        rows, cols = (tensors[name].shape + (0, 0))[:2]
        if tensors[name].ndim != 2 or cols != d or rows < config.vocab_size:
            raise CheckpointError(
                f"{where}: {name} is {tuple(tensors[name].shape)}, the config needs at least "
                f"({config.vocab_size}, {d})"
            )
    layers = {int(m[1]) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if layers - set(range(config.n_layer)):
        raise CheckpointError(
            f"{where}: layer {max(layers)} is beyond the config's {config.n_layer} layers"
        )


# -- safetensors ------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as float32 arrays (integers as they are).

    The ``safetensors`` library reads the file (and checks its header); it has no numpy
    bfloat16, so a BF16 tensor is read from the file's memory map at the offsets of the
    documented header (u64 little-endian length, then JSON: ``dtype``, ``shape``,
    ``data_offsets`` from the end of the header) and widened exactly."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as exc:  # pragma: no cover - a dependency of lmserve-core
        raise CheckpointError(f"{path}: needs the safetensors package ({exc})") from None
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            bf16 = []
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if f.get_slice(name).get_dtype() == "BF16":
                    bf16.append(name)
                    continue
                array = f.get_tensor(name)
                out[name] = array.astype(np.float32) if array.dtype.kind == "f" else array
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    if bf16:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        for name in bf16:
            entry = header[name]
            begin, end = entry["data_offsets"]
            raw = np.frombuffer(data, "<u2", count=(end - begin) // 2, offset=8 + n + begin)
            wide = raw.astype(np.uint32)
            wide <<= 16
            out[name] = wide.view(np.float32).reshape(entry["shape"])
    return dict(sorted(out.items()))


def _layout_config(model_file: Path) -> tuple[dict[str, Any], Path] | None:
    directory = model_file.parent
    for name in (f"{model_file.stem}.config.json", "config.json", "meta.json"):
        candidate = directory / name
        if candidate.is_file():
            doc = _json(candidate)
            if isinstance(doc, dict) and isinstance(doc.get("model_config"), dict):
                return doc["model_config"], candidate
            if isinstance(doc, dict) and "n_layer" in doc:
                return doc, candidate
    return None


def infer_model_config(
    tensors: dict[str, np.ndarray], vocab_size: int, where: Path
) -> dict[str, Any]:
    """A nanochat ``model_config`` from the shapes of a state dict (module docstring, (b))."""

    def shape(name: str) -> tuple[int, ...]:
        if name not in tensors:
            raise CheckpointError(f"{where}: no tensor {name}")
        return tuple(tensors[name].shape)

    n_layer = 0
    while f"transformer.h.{n_layer}.attn.c_q.weight" in tensors:
        n_layer += 1
    if not n_layer:
        raise CheckpointError(f"{where}: no tensor transformer.h.0.attn.c_q.weight")
    n_embd = shape("transformer.wte.weight")[-1]
    q_rows = shape("transformer.h.0.attn.c_q.weight")[0]
    k_rows = shape("transformer.h.0.attn.c_k.weight")[0]
    gates = sorted(k for k in tensors if k.endswith(".attn.ve_gate.weight"))
    if gates:
        n_kv_head = shape(gates[0])[0]
        head_dim = k_rows // n_kv_head if n_kv_head and k_rows % n_kv_head == 0 else 0
    else:
        head_dim = DEFAULT_HEAD_DIM
        n_kv_head = k_rows // head_dim
    if not head_dim or q_rows % head_dim or k_rows % head_dim or not n_kv_head:
        raise CheckpointError(
            f"{where}: cannot tell the heads from c_q {q_rows} and c_k {k_rows} rows (head size "
            f"{head_dim or '?'}): put the model_config beside it as model.config.json"
        )
    return {
        "sequence_len": DEFAULT_SEQUENCE_LEN,
        "vocab_size": vocab_size,
        "n_layer": n_layer,
        "n_head": q_rows // head_dim,
        "n_kv_head": n_kv_head,
        "n_embd": n_embd,
        "window_pattern": "L",
    }


def _beside(model_file: Path, given: str | Path | None, name: str) -> Path:
    """The tokenizer file: ``given`` (a file, or a directory holding ``name``), else ``name``
    beside the model."""
    path = Path(given) if given is not None else model_file.parent / name
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the tokenizer of {model_file})")
    return path


def _load_safetensors(directory: Path, tokenizer: str | Path | None) -> Checkpoint:
    model_file = directory / "model.safetensors"
    token_file = _beside(model_file, tokenizer, "tokenizer.bin")
    vocab = _vocab(token_file)
    tensors = {k.removeprefix(ORIG_MOD): v for k, v in read_safetensors(model_file).items()}
    found = _layout_config(model_file)
    if found is not None:
        model_config, config_file = found
        what = f"nanochat safetensors, geometry from {config_file.name}"
    else:
        model_config = infer_model_config(tensors, vocab.size, model_file)
        config_file, what = model_file, "nanochat safetensors, geometry inferred from shapes"
    config = from_model_config(model_config, _shapes(tensors), str(config_file))
    return _finish(config, tensors, vocab, model_file, what)


def _load_hf(directory: Path, tokenizer: str | Path | None) -> Checkpoint:
    config_file = directory / "config.json"
    model_file = directory / "model.safetensors"
    if not model_file.is_file():
        raise CheckpointError(f"{model_file}: missing (sharded checkpoints are not read)")
    token_file = _beside(model_file, tokenizer, "tokenizer.json")
    hf = _json(config_file)
    vocab = _vocab(token_file)
    tensors: dict[str, np.ndarray] = {}
    for name, array in read_safetensors(model_file).items():
        for pattern, native in _HF_NAMES:
            if pattern.fullmatch(name):
                tensors[pattern.sub(native, name)] = array
                break
        else:
            raise CheckpointError(
                f"{model_file}: unexpected tensor {name} (not of {HF_ARCHITECTURE})"
            )
    if "lm_head.weight" not in tensors and hf.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = tensors.get(
            "transformer.wte.weight", np.zeros((0, 0), np.float32)
        )
    config = from_hf_config(hf, str(config_file))
    rows = tensors.get("transformer.wte.weight", np.zeros((0, 0))).shape[0]
    if config.vocab_size != vocab.size:
        # config.json may give the padded size of the embedding: the tokenizer's is the model's
        if not vocab.size <= config.vocab_size <= rows:
            raise CheckpointError(
                f"{config_file}: vocab_size {config.vocab_size}, the tokenizer {token_file} has "
                f"{vocab.size}"
            )
        config = dataclasses.replace(config, vocab_size=vocab.size)
    return _finish(config, tensors, vocab, model_file, "nanochat (Hugging Face port)")
