"""Fuzzing what start-up reads of a GGUF: mutated headers, metadata counts and lengths,
tensor offsets, shapes and types of the real model files.

Every mutant is loaded the way ``lmserve`` starts (the family's backend factory: the
reader, the config, the weight table, the tokenizer, the chat template) in a child process
with a memory limit and a deadline: each
must load or fail with an error the command line reports cleanly (``ValueError``,
``OSError`` or the server's own errors), never crash, hang or allocate without bound.
Mutants are sparse copies (the header changed, the tensor data left as a hole), so the
real files' size costs nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models import gemma3_path, smollm2_path

from lmserve_core.gguf_file import GGUFFile

CHILD = r"""
import json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from lmserve_core.backend import ServerSettings
from lmserve_core.errors import LmserveError
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.plugins import backend_for_architecture

def load(path):
    gguf = GGUFFile.open(path)
    spec = backend_for_architecture(gguf.architecture)
    gguf.close()
    if spec is None:
        raise ValueError("no family")
    backend = spec.factory(path, ServerSettings(ctx=64, threads=1, kv_slots=1, batch=1))
    backend.close()

for path in sys.argv[1:]:
    try:
        load(path)
        result = "ok"
    except (ValueError, OSError, LmserveError) as exc:
        result = "refused: " + type(exc).__name__
    except BaseException as exc:
        result = "BUG: " + "".join(traceback.format_exception(exc))[-1500:]
    print(json.dumps([path, result]), flush=True)
"""

# values that break counts, lengths and offsets when they land on one
EXTREMES = [0, 1, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]


def _tensor_fields(header: bytes, names: list[str]) -> list[tuple[int, int]]:
    """(position of n_dims, n_dims) of each named tensor's info in the header."""
    out = []
    for name in names:
        raw = name.encode()
        at = header.rfind(len(raw).to_bytes(8, "little") + raw)
        if at >= 0:
            q = at + 8 + len(raw)
            out.append((q, int.from_bytes(header[q : q + 4], "little")))
    return out


def mutants(source: Path, out: Path, n: int, seed: int) -> list[Path]:
    gguf = GGUFFile.open(source)
    header_end = gguf.data_offset
    names = list(gguf.tensors)
    gguf.close()
    size = source.stat().st_size
    with open(source, "rb") as f:
        header = f.read(header_end)
    fields = _tensor_fields(header, names)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        data = bytearray(header)
        kind = i % 7
        q, n_dims = fields[int(rng.integers(len(fields)))]
        if kind == 4:  # another tensor type (f32, f16, q4_0, q4_1, q8_0, q4_K, q6_K, bf16)
            t = q + 4 + 8 * n_dims
            data[t : t + 4] = int(rng.choice([0, 1, 2, 3, 8, 12, 14, 30])).to_bytes(4, "little")
        elif kind == 5:  # dimensions swapped or scaled
            dims = [int.from_bytes(data[q + 4 + 8 * d : q + 12 + 8 * d], "little")
                    for d in range(n_dims)]
            dims = dims[::-1] if n_dims > 1 and rng.random() < 0.5 else [d * 2 for d in dims]
            for d, v in enumerate(dims):
                data[q + 4 + 8 * d : q + 12 + 8 * d] = v.to_bytes(8, "little")
        elif kind == 6:  # the data offset moved by a few alignments
            o = q + 8 + 8 * n_dims
            old = int.from_bytes(data[o : o + 8], "little")
            new = max(0, old + 32 * int(rng.integers(-4, 5)))
            data[o : o + 8] = new.to_bytes(8, "little")
        # most of a header is the vocabulary: aim a share at its first kilobytes, where
        # the counts, the key lengths and the first arrays are, and a share at its last
        # ones, the tensor infos (names, shapes, types, offsets)
        lo, hot = 0, header_end
        pick = rng.random()
        if pick < 0.4:
            hot = min(header_end, 4096)
        elif pick < 0.7:
            lo = max(0, header_end - 8192)
        if kind == 0:  # a few random bytes
            for at in rng.integers(lo, hot, size=int(rng.integers(1, 9))):
                data[at] = int(rng.integers(0, 256))
        elif kind == 1:  # an extreme 64-bit value over a count, length or offset
            at = int(rng.integers(lo, hot - 8))
            data[at : at + 8] = EXTREMES[int(rng.integers(len(EXTREMES)))].to_bytes(8, "little")
        elif kind == 2:  # an extreme 32-bit value (types, dimensions)
            at = int(rng.integers(lo, hot - 4))
            value = EXTREMES[int(rng.integers(len(EXTREMES)))] & 0xFFFFFFFF
            data[at : at + 4] = value.to_bytes(4, "little")
        elif kind == 3:  # cut anywhere in the header
            data = data[: int(rng.integers(0, header_end))]
        path = out / f"{source.stem}-{i}.gguf"
        with open(path, "wb") as f:
            f.write(data)
            if kind != 3:
                f.truncate(size)  # the tensor data: a hole of the original size
        paths.append(path)
    return paths


@pytest.mark.parametrize(("model", "n"), [("smollm2", 28), ("gemma3", 14)])
def test_mutated_real_headers_load_or_fail_cleanly(model: str, n: int, tmp_path: Path) -> None:
    source = smollm2_path() if model == "smollm2" else gemma3_path()
    paths = mutants(source, tmp_path, n, seed=20261130)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, paths)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    results = dict(json.loads(line) for line in child.stdout.splitlines() if line.startswith("["))
    assert child.returncode == 0, child.stderr[-3000:]
    assert len(results) == len(paths), child.stderr[-3000:]
    bugs = {p: r for p, r in results.items() if r.startswith("BUG")}
    assert not bugs, "\n\n".join(f"{p}:\n{r}" for p, r in bugs.items())
    assert any(r.startswith("refused") for r in results.values())  # the mutants do bite
