"""The KV disk tier: spills, restores, restarts, deduplication, eviction, and the files it
must refuse (over the scripted forward pass, whose cache rows record their tokens, so a
restored slot is checked row by row)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scripted import (  # noqa: F401  (the fixtures)
    IM_END,
    ScriptedModel,
    _gguf,
    _one_tokenizer,
    _tokenizer,
    check_shadow,
    ids,
    make_backend,
    run,
)

from lmserve_core.backend import ServerSettings
from lmserve_core.gguf_chat import GGUFChatBackend
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kv_disk import MAGIC, SUFFIX, DiskTier
from lmserve_core.model import FamilyConventions
from lmserve_core.request import Message, NormalizedRequest, Sampling
from lmserve_core.settings import DiskSettings

IDENTITY = {"model": "m1", "cache_kind": "attention", "geometry": [[1, 2, 2, 0]], "kv_type": "f16"}


def disk_backend(gguf: GGUFFile, tmp_path: Path, script: Any = (), **disk: Any) -> GGUFChatBackend:
    settings = ServerSettings(
        ctx=2048, kv_slots=1, batch=1, disk=DiskSettings(directory=str(tmp_path), **disk)
    )
    # its own handle of the file: closing the backend closes it
    return GGUFChatBackend(
        name="fake", gguf=GGUFFile.open(gguf.path), model=ScriptedModel(49152, script),  # type: ignore[arg-type]
        conventions=FamilyConventions(), settings=settings,
    )


def conversation(topic: str, *turns: str) -> NormalizedRequest:
    messages = [Message("system", f"You talk about {topic}. " * 30)]
    for i, text in enumerate(turns):
        messages.append(Message("user" if i % 2 == 0 else "assistant", text))
    return NormalizedRequest(id=f"{topic}-{len(turns)}", dialect="chat", messages=messages,
                             sampling=Sampling(temperature=0.0), max_tokens=8)


# ---------------------------------------------------------------------------- the tier


def test_store_match_load_and_containment(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, IDENTITY, max_files=4, max_bytes=1 << 20)
    state = np.arange(40, dtype=np.uint8)
    assert tier.store([1, 2, 3], state)
    assert not tier.store([1, 2], state)  # held by the longer file
    assert tier.store([1, 2, 3, 4, 5], state[:30])  # contains the first: it replaces it
    assert len(tier.entries) == 1 and len(list(tmp_path.glob("*" + SUFFIX))) == 1
    entry, common = tier.match([1, 2, 3, 9], limit=10)  # type: ignore[misc]
    assert common == 3 and entry.tokens.tolist() == [1, 2, 3, 4, 5]
    loaded = tier.load(entry)
    assert loaded is not None and loaded.tolist() == state[:30].tolist()
    assert tier.match([7, 8], limit=10) is None
    # a new tier over the same directory finds it (a restart)
    again = DiskTier(tmp_path, IDENTITY, max_files=4, max_bytes=1 << 20)
    assert [e.tokens.tolist() for e in again.entries] == [[1, 2, 3, 4, 5]]


def test_least_recently_used_files_go_first(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, IDENTITY, max_files=2, max_bytes=1 << 20)
    state = np.zeros(100, np.uint8)
    for first in (10, 20, 30):
        tier.store([first, 1], state)
    assert sorted(e.tokens[0] for e in tier.entries) == [20, 30]
    entry = next(e for e in tier.entries if e.tokens[0] == 20)
    tier.load(entry)  # used: 30 is now the oldest
    tier.store([40, 1], state)
    assert sorted(e.tokens[0] for e in tier.entries) == [20, 40]
    small = DiskTier(tmp_path / "small", IDENTITY, max_files=10, max_bytes=1200)
    for first in range(5):
        small.store([first], np.zeros(300, np.uint8))
    assert sum(e.size for e in small.entries) <= 1200 and len(small.entries) == 2


def test_bad_files_are_skipped_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = DiskTier(tmp_path, IDENTITY, max_files=8, max_bytes=1 << 20)
    for first in (1, 2, 3):
        tier.store([first, 5, 6], np.full(64, first, np.uint8))
    files = sorted(tmp_path.glob("*" + SUFFIX))
    corrupt, truncated, good = files
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF  # a flipped state byte: only the checksum sees it
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])  # half written
    (tmp_path / ("foreign" + SUFFIX)).write_bytes(b"not a KV file at all")
    other = DiskTier(tmp_path / "other", {**IDENTITY, "model": "m2"}, max_files=2, max_bytes=1 << 20)
    other.store([9, 9], np.zeros(8, np.uint8))
    (next((tmp_path / "other").glob("*" + SUFFIX))).rename(tmp_path / ("other" + SUFFIX))
    (tmp_path / ".partial.123.tmp").write_bytes(MAGIC + b"\x01")  # a write in progress
    capsys.readouterr()
    tier = DiskTier(tmp_path, IDENTITY, max_files=8, max_bytes=1 << 20)
    out = capsys.readouterr().out
    assert out.count("kv_disk_skipped") == 3  # truncated, foreign, other model
    assert "another model" in out and "not a KV file" in out
    assert len(tier.entries) == 2
    hit = tier.match([corrupt_first(tier, good)], limit=3)
    assert hit is not None
    bad = next(e for e in tier.entries if e.path == corrupt)
    assert tier.load(bad) is None  # the checksum refuses it
    assert "checksum" in capsys.readouterr().out
    assert len(tier.entries) == 1


def corrupt_first(tier: DiskTier, good: Path) -> int:
    return int(next(e for e in tier.entries if e.path == good).tokens[0])


# ---------------------------------------------------------------------------- the backend


def test_one_slot_alternating_conversations_spill_and_restore(
    gguf: GGUFFile, tmp_path: Path
) -> None:
    b0 = make_backend(gguf)
    script = ids(b0, "Fine.") + [IM_END]
    backend = disk_backend(gguf, tmp_path, script, max_files=4)
    run(backend, conversation("cats", "hi"))
    run(backend, conversation("ships", "hello"))  # evicts cats: spilled
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1
    assert backend.slots.last_tier == "none"
    back, _ = run(backend, conversation("cats", "hi", "Fine.", "more"))
    assert backend.slots.last_tier == "disk"
    assert back.usage.cached_tokens > 150  # the whole first turn came back
    again, _ = run(backend, conversation("ships", "hello", "Fine.", "more"))
    assert backend.slots.last_tier == "disk" and again.usage.cached_tokens > 150
    check_shadow(backend)  # restored rows hold exactly their tokens
    assert backend.slots.disk is not None and backend.slots.disk.stats.hits == 2
    from lmserve_core.engine import Engine

    metrics = Engine(backend).metrics.render().decode()
    assert "lmserve_kv_disk_hits_total 2.0" in metrics
    assert f"lmserve_kv_disk_spills_total {float(backend.slots.disk.stats.spills)}" in metrics
    assert backend.slots.disk.stats.spills == 3  # ships, then cats, then cats with its reply


def test_a_restart_serves_the_first_request_from_disk(gguf: GGUFFile, tmp_path: Path) -> None:
    b0 = make_backend(gguf)
    script = ids(b0, "Fine.") + [IM_END]
    first = disk_backend(gguf, tmp_path, script)
    cold, cold_sink = run(first, conversation("cats", "hi"))
    first.close()  # a graceful stop stores the resident slot
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1
    second = disk_backend(gguf, tmp_path, script)
    warm, warm_sink = run(second, conversation("cats", "hi", "Fine.", "more"))
    assert second.slots.last_tier == "disk"
    assert warm.usage.cached_tokens >= cold.usage.prompt_tokens - 1
    check_shadow(second)
    # a server of another KV layout refuses the files
    model = ScriptedModel(49152, script)
    model.kv_type = "f32"  # type: ignore[attr-defined]
    other = GGUFChatBackend(
        name="fake", gguf=GGUFFile.open(gguf.path), model=model,  # type: ignore[arg-type]
        conventions=FamilyConventions(),
        settings=ServerSettings(ctx=2048, kv_slots=1, batch=1,
                                disk=DiskSettings(directory=str(tmp_path))),
    )
    assert other.slots.disk is not None and other.slots.disk.entries == []


def test_two_servers_sharing_a_directory_keep_every_file_whole(tmp_path: Path) -> None:
    import subprocess
    import sys

    # two processes write the same conversations and their own ones at once
    script = (
        "import sys, numpy as np\n"
        "from lmserve_core.kv_disk import DiskTier\n"
        f"identity = {IDENTITY!r}\n"
        "tier = DiskTier(sys.argv[1], identity, max_files=200, max_bytes=1 << 30)\n"
        "me = int(sys.argv[2])\n"
        "for i in range(40):\n"
        "    tier.store([i, 1, 2, 3], np.full(50_000, i, np.uint8))\n"
        "    tier.store([1000 * me + i, 7], np.full(50_000, me, np.uint8))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(me)])
             for me in (1, 2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    tier = DiskTier(tmp_path, IDENTITY, max_files=200, max_bytes=1 << 30)
    assert len(tier.entries) == 120  # 40 shared, 40 of each
    for entry in tier.entries:
        state = tier.load(entry)
        assert state is not None  # whole: its checksum holds
    assert not list(tmp_path.glob("*.tmp"))


def test_a_bad_file_falls_back_to_the_next_best(tmp_path: Path) -> None:
    from scripted import FakeCache

    from lmserve_core.kv_slots import SlotPool

    tier = DiskTier(tmp_path, IDENTITY, max_files=8, max_bytes=1 << 20)
    for tokens in ([*range(10), 50, 51], [*range(10), 60, 61, 62]):
        cache = FakeCache(64)
        cache.rows[: len(tokens)] = tokens
        tier.store(tokens, cache.snapshot(len(tokens)))
    best = max(tier.entries, key=lambda e: e.tokens.size)
    data = bytearray(best.path.read_bytes())
    data[-1] ^= 0xFF
    best.path.write_bytes(bytes(data))
    pool = SlotPool(1, lambda: FakeCache(64), disk=tier)
    slot, n = pool.adopt([*range(10), 60, 61, 62, 99])
    assert pool.last_tier == "disk" and n == 10  # from the other file
    assert slot.cache.rows[:10].tolist() == list(range(10))
    assert best not in tier.entries  # the corrupt one is out of the index
