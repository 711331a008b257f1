"""The KV disk tier: slot contents kept in files, across evictions and restarts.

A slot about to be overwritten by an unrelated conversation is *spilled* to a file; a later
request whose prompt shares a longer prefix with a file than with any resident slot
*restores* it and prefills only the rest. At a graceful stop the resident slots are stored
too, and at start-up the directory is scanned, so a restarted server picks up where the
last one left off.

Each file is self-describing: ``LMKV``, a format version, a JSON header (the model's
fingerprint, the cache's kind, geometry and KV type, the token count, the state's size and
SHA-256; under a cartridge, the prefix's row count, geometry and digest), the token shadow
(int32) and the cache state (a prefix's rows first: a restore brings back the very prefix
the file was kept under). Files are written under a temporary name, fsynced and renamed,
and named by the hash of their model, prefix and tokens, so two servers
sharing a directory write identical files under identical names and never a half file
under a final one. A file that is truncated, corrupt, foreign or of another model is skipped
with a warning. Files are deduplicated by containment (a stored prefix of a longer stored
conversation is dropped) and evicted least recently used within a count and a size.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from .progress import Report, tracker

log = structlog.get_logger("lmserve.kv_disk")

MAGIC = b"LMKV"
VERSION = 1
SUFFIX = ".lmkv"
_PREFIX = struct.Struct("<4sII")  # magic, version, header length
_MAX_HEADER = 1 << 20


class DiskTierError(ValueError):
    """A file that cannot serve this model (why it was skipped)."""


@dataclass(slots=True)
class StoredPrefix:
    """One file of the tier: the tokens whose rows it holds."""

    path: Path
    tokens: np.ndarray  # int32
    state_offset: int  # where the state starts in the file
    state_bytes: int
    sha256: str
    size: int  # of the whole file
    used: float  # last use (the file's mtime), for LRU


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # requests served from a file
    misses: int = 0  # requests that found no file worth restoring
    spills: int = 0  # files written
    bytes_written: int = 0
    bytes_read: int = 0
    skipped: int = 0  # files refused at scan or load


def model_fingerprint(gguf: Any) -> str:
    """A hash of what makes a model's KV rows its own: the architecture, every tensor's
    name, shape, type and offset, the file's size and the first MiB of its tensor data (a
    different quantisation or fine-tune of the same architecture differs in these)."""
    h = hashlib.sha256()
    h.update(str(getattr(gguf, "architecture", "")).encode())
    for name, info in sorted(gguf.tensors.items()):
        h.update(
            f"{name}:{tuple(info.shape)}:{info.ggml_type}:{getattr(info, 'offset', 0)};".encode()
        )
    path = Path(gguf.path)
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        f.seek(int(getattr(gguf, "data_offset", 0)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


class DiskTier:
    """The files of one directory that serve one model and cache layout."""

    def __init__(
        self, directory: str | os.PathLike[str], identity: dict[str, Any], *,
        max_files: int, max_bytes: int,
    ) -> None:
        if max_files < 1 or max_bytes < 1:
            raise ValueError("the disk tier needs room for at least one file")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity  # model fingerprint, cache kind, geometry, kv type
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.entries: list[StoredPrefix] = []
        self.stats = TierStats()
        self._lock = threading.Lock()
        self.scan()

    # ------------------------------------------------------------------ index

    def scan(self, progress: Report | None = None) -> None:
        """Index every valid file of the directory; skip the others with a warning.
        ``progress(done, total)`` is called with the files read so far after each
        (default: :func:`lmserve_core.progress.tracker`'s)."""
        report = progress or tracker("kv_disk_scan", "scanning the KV disk tier", unit="files")
        entries = []
        paths = sorted(self.dir.glob("*" + SUFFIX))
        for done, path in enumerate(paths, 1):
            try:
                entries.append(self._read_index(path))
            except (DiskTierError, OSError) as exc:
                self.stats.skipped += 1
                log.warning("kv_disk_skipped", path=str(path), reason=str(exc))
            report(done, len(paths))
        report(len(paths), len(paths))  # an empty directory ends it too
        with self._lock:
            self.entries = entries
        log.info("kv_disk", dir=str(self.dir), files=len(entries),
                 bytes=sum(e.size for e in entries), max_files=self.max_files,
                 max_bytes=self.max_bytes)
        self._evict()

    def _read_index(self, path: Path) -> StoredPrefix:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_PREFIX.size)
            if len(head) < _PREFIX.size:
                raise DiskTierError("truncated header")
            magic, version, header_len = _PREFIX.unpack(head)
            if magic != MAGIC:
                raise DiskTierError("not a KV file")
            if version != VERSION:
                raise DiskTierError(f"format version {version}, not {VERSION}")
            if header_len > _MAX_HEADER:
                raise DiskTierError("header too long")
            try:
                header = json.loads(f.read(header_len))
            except (ValueError, UnicodeDecodeError) as exc:
                raise DiskTierError(f"unreadable header: {exc}") from None
            if not isinstance(header, dict):
                raise DiskTierError("unreadable header")
            for key, want in self.identity.items():
                if header.get(key) != want:
                    if key == "prefix":
                        raise DiskTierError(_other_prefix(header.get(key), want))
                    raise DiskTierError(f"{key} differs: another model or cache layout")
            n = header.get("n_tokens")
            state_bytes = header.get("state_bytes")
            digest = header.get("sha256")
            if not (isinstance(n, int) and isinstance(state_bytes, int) and n > 0
                    and state_bytes > 0 and isinstance(digest, str)):
                raise DiskTierError("header lacks its sizes")
            state_offset = _PREFIX.size + header_len + 4 * n
            if size != state_offset + state_bytes:
                raise DiskTierError(f"{size} bytes where {state_offset + state_bytes} belong")
            tokens = np.frombuffer(f.read(4 * n), dtype="<i4").astype(np.int32)
        return StoredPrefix(path, tokens, state_offset, state_bytes, digest, size,
                            path.stat().st_mtime)

    def match(self, prompt: Sequence[int], limit: int) -> tuple[StoredPrefix, int] | None:
        """The file sharing the longest prefix with ``prompt`` (at most ``limit`` tokens),
        and that length."""
        ranked = self.matches(prompt, limit)
        return ranked[0] if ranked else None

    def matches(self, prompt: Sequence[int], limit: int) -> list[tuple[StoredPrefix, int]]:
        """Every file sharing a prefix with ``prompt`` (at most ``limit`` tokens) and its
        length, the longest first (the most recently used among equals)."""
        if not prompt:
            return []
        ids = np.asarray(prompt[:limit], dtype=np.int32)
        with self._lock:
            entries = list(self.entries)
        found = []
        for entry in entries:
            n = min(ids.size, entry.tokens.size)
            diff = np.flatnonzero(ids[:n] != entry.tokens[:n])
            common = int(diff[0]) if diff.size else n
            if common > 0:
                found.append((entry, common))
        found.sort(key=lambda m: (m[1], m[0].used), reverse=True)
        return found

    def holds(self, tokens: Sequence[int]) -> bool:
        """True when a file holds ``tokens`` (or a longer conversation starting with them)."""
        ids = np.asarray(tokens, dtype=np.int32)
        with self._lock:
            return any(
                e.tokens.size >= ids.size and np.array_equal(e.tokens[: ids.size], ids)
                for e in self.entries
            )

    # ------------------------------------------------------------------ read and write

    def load(self, entry: StoredPrefix) -> np.ndarray | None:
        """The cache state of ``entry``; None (and the entry dropped) when its file is gone
        or does not hold what its header promises."""
        try:
            with open(entry.path, "rb") as f:
                f.seek(entry.state_offset)
                state = np.frombuffer(f.read(entry.state_bytes), dtype=np.uint8)
            if state.size != entry.state_bytes:
                raise DiskTierError("truncated state")
            if hashlib.sha256(state.tobytes()).hexdigest() != entry.sha256:
                raise DiskTierError("the state does not match its checksum")
            os.utime(entry.path)
        except (OSError, DiskTierError) as exc:
            self.stats.skipped += 1
            log.warning("kv_disk_skipped", path=str(entry.path), reason=str(exc))
            self._drop(entry)
            return None
        entry.used = time.time()
        self.stats.bytes_read += state.size
        return state

    def store(self, tokens: Sequence[int], state: np.ndarray) -> bool:
        """Write ``tokens`` and their cache ``state`` to a file, unless a file already holds
        them; files holding a prefix of them are dropped. False when nothing was written."""
        ids = np.asarray(tokens, dtype=np.int32)
        if ids.size == 0 or self.holds(tokens):
            return False
        raw = np.ascontiguousarray(state, dtype=np.uint8)
        digest = hashlib.sha256(raw.tobytes()).hexdigest()
        header = json.dumps({
            **self.identity, "n_tokens": int(ids.size), "state_bytes": int(raw.size),
            "sha256": digest, "written": time.time(),
        }).encode()
        body = ids.astype("<i4").tobytes()
        size = _PREFIX.size + len(header) + len(body) + raw.size
        if size > self.max_bytes:
            return False
        # a conversation kept under a prefix (a cartridge) is another file than the same
        # tokens without it, or under another prefix
        prefix = self.identity.get("prefix")
        owner = str(self.identity.get("model")) + ("" if not prefix else str(prefix["sha256"]))
        key = hashlib.sha256(owner.encode() + body).hexdigest()[:32]
        final = self.dir / f"{key}{SUFFIX}"
        tmp = self.dir / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
                f.write(header)
                f.write(body)
                f.write(raw.tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except OSError as exc:
            log.warning("kv_disk_write_failed", path=str(final), reason=str(exc))
            tmp.unlink(missing_ok=True)
            return False
        entry = StoredPrefix(final, ids.copy(), _PREFIX.size + len(header) + len(body),
                             int(raw.size), digest, size, time.time())
        with self._lock:
            contained = [
                e for e in self.entries
                if e.path != final and e.tokens.size <= ids.size
                and np.array_equal(ids[: e.tokens.size], e.tokens)
            ]
            self.entries = [e for e in self.entries if e not in contained and e.path != final]
            self.entries.append(entry)
        for e in contained:
            e.path.unlink(missing_ok=True)
        self.stats.spills += 1
        self.stats.bytes_written += size
        self._evict()
        return True

    def _drop(self, entry: StoredPrefix) -> None:
        with self._lock:
            self.entries = [e for e in self.entries if e is not entry]

    def _evict(self) -> None:
        """Least recently used files out, until the count and the size fit."""
        with self._lock:
            self.entries.sort(key=lambda e: e.used)
            gone = []
            while self.entries and (
                len(self.entries) > self.max_files
                or sum(e.size for e in self.entries) > self.max_bytes
            ):
                gone.append(self.entries.pop(0))
        for e in gone:
            e.path.unlink(missing_ok=True)
            log.info("kv_disk_evicted", path=str(e.path), tokens=int(e.tokens.size))


def _other_prefix(found: Any, want: Any) -> str:
    """Why a file kept under another KV prefix (a cartridge, or none) does not serve."""

    def say(prefix: Any) -> str:
        if not isinstance(prefix, dict):
            return "no cartridge"
        return f"a cartridge of {prefix.get('rows')} rows (sha256 {str(prefix.get('sha256'))[:12]})"

    return f"kept under {say(found)}, this server runs {say(want)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
