"""The cartridge file: a KV prefix as safetensors, the reference design's layout.

Per layer ``i``: ``layers.{i}.k_sink`` / ``layers.{i}.v_sink`` ``[1, n_kv_heads, head_dim]``
hold the frozen attention-sink row (position 0) and ``layers.{i}.k`` / ``layers.{i}.v``
``[p-1, n_kv_heads, head_dim]`` the other rows (positions 1..p-1). Keys are stored as the
cache holds them: after the k-norm and after RoPE at their positions. An optional 1-D
integer ``draft_reference`` holds corpus token ids. Written as float32; float32, float16 and
bfloat16 are accepted on read. The safetensors metadata (a string map) records
``format`` = ``lmserve-cartridge/1``, ``architecture``, ``n_layer``, ``n_kv_heads`` and
``head_dim`` (comma-separated per layer when the layers differ), ``p``, ``init``
(``prefill`` or ``trained``) and the model's identity (``model``: the GGUF file name,
``model_id``). Reference-design files carry no metadata; they read too, with the geometry
taken from the tensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "lmserve-cartridge/1"
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(k|v|k_sink|v_sink)$")
_FLOAT_DTYPES = ("F32", "F16", "BF16")


class CartridgeError(ValueError):
    """A file that is not a usable cartridge, or one that does not fit the model."""


@dataclass
class Cartridge:
    """A KV prefix of ``p`` rows per layer: ``k[i]`` and ``v[i]`` are float32 arrays
    ``[p, n_kv_heads_i, head_dim_i]``, row 0 the sink. ``frozen_prefix`` rows (the sink) are
    stored apart from the rest."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    metadata: dict[str, str] = field(default_factory=dict)
    frozen_prefix: int = 1
    draft_reference: np.ndarray | None = None  # int64 corpus tokens, optional
    path: str | None = None  # the file it was read from (read_cartridge sets it)

    def __post_init__(self) -> None:
        if not self.k or len(self.k) != len(self.v):
            raise CartridgeError(
                f"a cartridge needs the same number of k and v layers (got {len(self.k)} "
                f"and {len(self.v)})"
            )
        p = self.k[0].shape[0] if self.k[0].ndim == 3 else -1
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k.ndim != 3 or k.shape != v.shape or k.shape[0] != p:
                raise CartridgeError(
                    f"layer {i}: k {list(k.shape)} and v {list(v.shape)} must both be "
                    f"[p, n_kv_heads, head_dim] with p = {p}"
                )
        if p < 1 or not 0 <= self.frozen_prefix <= p:
            raise CartridgeError(f"p = {p} rows with {self.frozen_prefix} frozen: not a prefix")

    @property
    def p(self) -> int:
        """Rows of the prefix: the position the first real token takes."""
        return int(self.k[0].shape[0])

    @property
    def n_layer(self) -> int:
        return len(self.k)

    @property
    def n_kv_heads(self) -> list[int]:
        return [int(k.shape[1]) for k in self.k]

    @property
    def head_dim(self) -> list[int]:
        return [int(k.shape[2]) for k in self.k]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k, self.v, strict=True))


def _per_layer(values: list[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else ",".join(map(str, values))


def write_cartridge(path: str | os.PathLike[str], cartridge: Cartridge) -> None:
    """Write ``cartridge`` to ``path`` (float32), atomically (a temporary file renamed)."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    f = cartridge.frozen_prefix
    for i, (k, v) in enumerate(zip(cartridge.k, cartridge.v, strict=True)):
        k32 = np.ascontiguousarray(k, dtype=np.float32)
        v32 = np.ascontiguousarray(v, dtype=np.float32)
        if f:
            tensors[f"layers.{i}.k_sink"] = np.ascontiguousarray(k32[:f])
            tensors[f"layers.{i}.v_sink"] = np.ascontiguousarray(v32[:f])
        tensors[f"layers.{i}.k"] = np.ascontiguousarray(k32[f:])
        tensors[f"layers.{i}.v"] = np.ascontiguousarray(v32[f:])
    if cartridge.draft_reference is not None:
        tensors["draft_reference"] = np.ascontiguousarray(cartridge.draft_reference, np.int64)
    meta = {k: str(v) for k, v in cartridge.metadata.items()}
    meta.update(
        format=FORMAT,
        n_layer=str(cartridge.n_layer),
        n_kv_heads=_per_layer(cartridge.n_kv_heads),
        head_dim=_per_layer(cartridge.head_dim),
        p=str(cartridge.p),
    )
    meta.setdefault("init", "prefill")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _as_f32(f: _Opened, name: str) -> np.ndarray:
    """One tensor as float32; bfloat16 (which numpy lacks) is widened from its bytes."""
    dtype = f.dtype(name)
    if dtype not in _FLOAT_DTYPES:
        raise CartridgeError(f"{name}: dtype {dtype} (a cartridge holds F32, F16 or BF16)")
    if dtype == "BF16":
        data, shape = f.raw(name)
        raw = np.frombuffer(data, dtype="<u2").reshape(shape)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(f.get_tensor(name), dtype=np.float32)


class _Opened:
    """A safetensors file through the library: names, dtypes, metadata and numpy tensors
    (``safe_open``), and for bfloat16 the raw bytes (``deserialize``)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        self._raw: dict[str, tuple[bytes, list[int]]] | None = None
        try:
            self._f = safe_open(str(path), framework="numpy")
        except Exception as e:  # the library raises its own error types for bad files
            raise CartridgeError(f"{path}: not a safetensors file ({e})") from e
        self.metadata: dict[str, str] = dict(self._f.metadata() or {})

    def names(self) -> list[str]:
        return list(self._f.keys())

    def dtype(self, name: str) -> str:
        return str(self._f.get_slice(name).get_dtype())

    def get_tensor(self, name: str) -> np.ndarray:
        return self._f.get_tensor(name)  # type: ignore[no-any-return]

    def raw(self, name: str) -> tuple[bytes, list[int]]:
        if self._raw is None:
            from safetensors import deserialize

            found = deserialize(self.path.read_bytes())
            self._raw = {n: (bytes(t["data"]), list(t["shape"])) for n, t in found}
        return self._raw[name]


def read_cartridge(path: str | os.PathLike[str]) -> Cartridge:
    """Read a cartridge file; :class:`CartridgeError` says what is wrong with one that is
    not a cartridge, misses a layer or holds a tensor of the wrong shape."""
    path = Path(path)
    if not path.is_file():
        raise CartridgeError(f"{path}: no such file")
    f = _Opened(path)
    fmt = f.metadata.get("format")
    if fmt is not None and fmt != FORMAT:
        raise CartridgeError(f"{path}: format {fmt!r}, not {FORMAT!r}")
    layers: dict[int, set[str]] = {}
    for name in f.names():
        m = _LAYER_KEY.match(name)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
        elif name != "draft_reference":
            raise CartridgeError(f"{path}: unexpected tensor {name!r} in a cartridge")
    if not layers:
        raise CartridgeError(f"{path}: not a cartridge (no layers.{{i}}.k / layers.{{i}}.v)")
    n_layer = max(layers) + 1
    declared = f.metadata.get("n_layer")
    if declared is not None and declared.isdigit():
        n_layer = max(n_layer, int(declared))
    has_sink = "k_sink" in layers.get(0, set())
    ks: list[np.ndarray] = []
    vs: list[np.ndarray] = []
    frozen = -1
    p = -1
    for i in range(n_layer):
        want = {"k", "v", "k_sink", "v_sink"} if has_sink else {"k", "v"}
        have = layers.get(i, set())
        if have != want:
            missing = sorted(want - have) or sorted(have - want)
            raise CartridgeError(
                f"{path}: layer {i} of {n_layer}: "
                + (
                    f"missing {', '.join(f'layers.{i}.{m}' for m in missing)}"
                    if want - have
                    else f"unexpected {', '.join(f'layers.{i}.{m}' for m in missing)}"
                )
            )
        rows = {}
        for part in sorted(want):
            a = _as_f32(f, f"layers.{i}.{part}")
            if a.ndim != 3:
                raise CartridgeError(
                    f"{path}: layers.{i}.{part} has shape {list(a.shape)}, expected "
                    "[rows, n_kv_heads, head_dim]"
                )
            rows[part] = a
        if rows["k"].shape != rows["v"].shape:
            raise CartridgeError(
                f"{path}: layers.{i}.k {list(rows['k'].shape)} and layers.{i}.v "
                f"{list(rows['v'].shape)} differ in shape"
            )
        if has_sink:
            for part in ("k", "v"):
                s, r = rows[f"{part}_sink"].shape, rows[part].shape
                if s[1:] != r[1:] or rows["k_sink"].shape != rows["v_sink"].shape:
                    raise CartridgeError(
                        f"{path}: layers.{i}.{part}_sink {list(s)} does not match "
                        f"layers.{i}.{part} {list(r)}"
                    )
            k = np.concatenate([rows["k_sink"], rows["k"]])
            v = np.concatenate([rows["v_sink"], rows["v"]])
            layer_frozen = rows["k_sink"].shape[0]
        else:
            k, v, layer_frozen = rows["k"], rows["v"], 0
        if i == 0:
            frozen, p = layer_frozen, k.shape[0]
        elif k.shape[0] != p or layer_frozen != frozen:
            raise CartridgeError(
                f"{path}: layers.{i}.k has {k.shape[0] - layer_frozen} rows and "
                f"{layer_frozen} sink rows; layer 0 has {p - frozen} and {frozen}"
            )
        ks.append(np.ascontiguousarray(k, dtype=np.float32))
        vs.append(np.ascontiguousarray(v, dtype=np.float32))
    declared_p = f.metadata.get("p")
    if declared_p is not None and declared_p != str(p):
        raise CartridgeError(f"{path}: metadata says p = {declared_p}, the tensors hold {p} rows")
    draft = None
    if "draft_reference" in f.names():
        draft = np.asarray(f.get_tensor("draft_reference")).astype(np.int64).reshape(-1)
    return Cartridge(
        k=ks, v=vs, metadata=f.metadata, frozen_prefix=frozen, draft_reference=draft,
        path=str(path),
    )


def check_geometry(
    cartridge: Cartridge,
    n_kv_heads: list[int],
    head_dim: list[int],
    *,
    source: str = "cartridge",
    model: str = "the model",
) -> None:
    """Raise :class:`CartridgeError` naming the first layer whose shape does not fit a model
    of ``len(n_kv_heads)`` layers with these per-layer KV heads and head sizes."""
    if cartridge.n_layer != len(n_kv_heads):
        raise CartridgeError(f"{source}: {cartridge.n_layer} layers, {model} has {len(n_kv_heads)}")
    for i, (k, h, d) in enumerate(zip(cartridge.k, n_kv_heads, head_dim, strict=True)):
        if k.shape[1:] != (h, d):
            raise CartridgeError(
                f"{source}: layers.{i}.k has shape {[k.shape[0] - cartridge.frozen_prefix, *k.shape[1:]]}"
                f" ([rows, n_kv_heads, head_dim]); layer {i} of {model} needs "
                f"[{k.shape[0] - cartridge.frozen_prefix}, {h}, {d}]"
            )
