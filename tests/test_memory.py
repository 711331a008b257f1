"""The C heap settings of the server process (glibc)."""

from __future__ import annotations

import ctypes
import platform
from typing import Any

import numpy as np
import pytest

from lmserve_core import memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


def _kib(field: str, path: str = "/proc/self/smaps_rollup") -> int:
    """A ``field:`` line of a /proc file, in KiB."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} line in {path}")


def _anon_kib() -> int:
    return _kib("Anonymous")


@glibc
def test_large_blocks_keep_their_own_mappings() -> None:
    assert memory.fix_mmap_threshold()
    # Blocks above the threshold are mapped and unmapped as they come and go: freeing
    # a few hundred MiB of 1 MiB blocks gives the memory back at once.
    before = _anon_kib()
    blocks = [np.ones(2**18, np.float32) for _ in range(300)]  # 300 x 1 MiB
    grown = _anon_kib() - before
    del blocks
    assert grown > 250 * 1024
    assert _anon_kib() - before < 16 * 1024


@glibc
def test_trim_returns_freed_heap() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    small = [libc.malloc(1024) for _ in range(50_000)]  # 50 MB below the threshold
    for p in small:
        libc.free(p)
    before = _anon_kib()
    memory.trim()
    assert _anon_kib() <= before


def test_ram_guard_fits_warns_clamps_and_forces() -> None:
    from lmserve_core.memory import plan_kv_slots

    gib = 2**30
    assert plan_kv_slots(gib, 4, 16 * gib, force=False) == (4, "fits")
    assert plan_kv_slots(gib, 4, 6 * gib, force=False) == (4, "warn")  # over half
    assert plan_kv_slots(gib, 4, 3 * gib, force=False) == (1, "clamped")  # fits in half
    assert plan_kv_slots(gib, 8, 7 * gib, force=False) == (3, "clamped")
    assert plan_kv_slots(gib, 4, 3 * gib, force=True) == (4, "forced")
    assert plan_kv_slots(4 * gib, 2, gib, force=False) == (1, "clamped")  # always one
    assert plan_kv_slots(gib, 4, None, force=False) == (4, "unknown")


def test_auto_slots_hold_what_an_eighth_of_memory_holds() -> None:
    from lmserve_core.memory import AUTO_SLOTS_MAX, auto_kv_slots

    gib = 2**30
    assert auto_kv_slots(gib, 80 * gib, 4) == 10
    assert auto_kv_slots(gib, 8 * gib, 4) == 4  # never fewer than the batch
    assert auto_kv_slots(2**20, 1024 * gib, 4) == AUTO_SLOTS_MAX
    assert auto_kv_slots(None, 8 * gib, 3) == 3 and auto_kv_slots(gib, None, 2) == 2


def test_kv_slots_parses_a_count_or_auto() -> None:
    from lmserve_core.backend import AUTO_SLOTS
    from lmserve_core.cluster.command import _replica_argv
    from lmserve_core.launch import build_parser

    parser = build_parser()
    assert parser.parse_args(["m.gguf", "--kv-slots", "auto"]).kv_slots == AUTO_SLOTS
    assert parser.parse_args(["m.gguf", "--kv-slots", "6"]).kv_slots == 6
    for bad in ("0", "-2", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["m.gguf", "--kv-slots", bad])
    # a cluster's replicas size their slots from memory unless told otherwise
    assert _replica_argv(["m.gguf"], 1)[-2:] == ["--kv-slots", "auto"]
    assert "auto" not in _replica_argv(["m.gguf", "--kv-slots=3"], 1)


def test_available_memory_is_read_from_the_system() -> None:
    from lmserve_core.memory import available

    avail = available()
    assert avail is None or avail > 2**20


@pytest.mark.parametrize(
    ("available", "force", "slots", "batch", "wanted"),
    [(None, False, 4, 4, 1), (12 * 2**20, False, 4, 4, 1), (7 * 2**20, False, 1, 1, 1),
     (7 * 2**20, True, 4, 4, 1), (96 * 2**20, False, 6, 4, 0), (16 * 2**20, False, 4, 4, 0)],
)
def test_backend_keeps_the_slots_the_guard_allows(
    available: int | None, force: bool, slots: int, batch: int, wanted: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from models import smollm2_path
    from scripted import ScriptedModel

    from lmserve_core.backend import ServerSettings
    from lmserve_core.gguf_chat import GGUFChatBackend
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.model import FamilyConventions

    class Priced(ScriptedModel):
        kv_bytes_per_pos = 1024  # 2 MiB a slot of 2048 positions

        def kv_bytes(self, n_ctx: int) -> int:
            return self.kv_bytes_per_pos * n_ctx

    backend = GGUFChatBackend(
        name="fake", gguf=GGUFFile.open(smollm2_path()), model=Priced(49152),  # type: ignore[arg-type]
        conventions=FamilyConventions(),
        settings=ServerSettings(ctx=2048, kv_slots=wanted, batch=4, kv_slots_force=force,
                                available_memory=available),
    )
    assert len(backend.slots.slots) == slots and backend.batch_size == batch
    out = capsys.readouterr().out
    assert "kv_memory" in out and "bytes_per_slot" in out
    if slots < 4:
        assert "clamped" in out
    elif available is not None and available < 16 * 2**20:
        assert "more than half" in out


def _serve_once(tmp_path, event: str, *flags: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Start lmserve on SmolLM2 with ``flags``, have it answer one chat, and return the
    start-up log ``event``."""
    import json

    import httpx
    from models import smollm2_path
    from processes import API_KEY, launch

    running = launch(str(smollm2_path()), "--threads", "2", *flags, scripted=False,
                     log_dir=tmp_path, timeout=120)
    try:
        reply = httpx.post(
            running.base_url + "/v1/chat/completions", timeout=120,
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": "m", "max_tokens": 4,
                  "messages": [{"role": "user", "content": "Hello"}]},
        )
        assert reply.status_code == 200, reply.text
        log = running.log_text()
    finally:
        running.stop()
    events = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
    return next(e for e in events if e.get("event") == event)


def test_server_keeps_the_slots_that_fit_in_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A real server asked for more KV slots than the machine's memory holds starts with the
    # slots that fit in half of it, says so, and serves.
    from lmserve_core.memory import available

    avail = available()
    if avail is None:
        pytest.skip("the system does not report its available memory")
    # SmolLM2 at 8192 positions: 30 layers of 3 kv heads of 64 f16 keys and values a position
    per_slot = 8192 * 30 * 2 * 3 * 64 * 2
    wanted = 2 * avail // per_slot + 2
    event = _serve_once(tmp_path, "kv_memory", "--ctx", "8192", "--kv-slots", str(wanted))
    assert event["verdict"] == "clamped" and event["bytes_per_slot"] == per_slot
    assert event["slots"] == wanted
    kept, seen = event["kept_slots"], event["available_bytes"]
    assert 1 <= kept < wanted and kept * per_slot <= seen // 2 < (kept + 1) * per_slot


# ------------------------------------------------------------------ weights
def test_weights_mode_is_one_of_three() -> None:
    assert memory.weights_mode() == "auto"
    try:
        memory.set_weights_mode("copy")
        assert memory.weights_mode() == "copy"
        with pytest.raises(ValueError, match="auto, copy, map"):
            memory.set_weights_mode("mlock")
        assert memory.weights_mode() == "copy"
    finally:
        memory.set_weights_mode("auto")


def test_weight_arena_places_aligned_copies_of_their_own() -> None:
    rng = np.random.default_rng(0)
    arena = memory.WeightArena()
    small = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 100, 4096, 70_000)]
    big = rng.integers(0, 256, arena.CHUNK // 4 + 1, dtype=np.uint8)  # a mapping of its own
    sources = [*small, big]
    copies = [arena.copy(a) for a in sources]
    wants = [a.copy() for a in sources]
    for a in sources:
        a[:] = 0  # the arena holds bytes of its own
    for copy, want in zip(copies, wants, strict=True):
        assert copy.ctypes.data % arena.ALIGN == 0 and copy.flags.writeable
        np.testing.assert_array_equal(copy, want)
    spans = sorted((c.ctypes.data, c.ctypes.data + c.nbytes) for c in copies)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert arena.bytes == sum(c.nbytes for c in copies)
    floats = arena.copy(np.arange(10, dtype=np.float32))  # any array: its bytes
    assert floats.nbytes == 40 and floats.view(np.float32)[9] == 9.0


def _thp_setting(name: str) -> str | None:
    """The chosen value of a transparent huge page setting ("[madvise]" in the file)."""
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@pytest.mark.skipif(
    _thp_setting("enabled") not in ("madvise", "always")
    or _thp_setting("defrag") not in ("madvise", "always", "defer+madvise"),
    reason="no transparent huge pages, or none found at fault time",
)
def test_weight_arena_memory_is_backed_by_huge_pages() -> None:
    arena = memory.WeightArena()
    block = arena.alloc(16 << 20)
    block[:] = 1  # commit every page
    start = block.ctypes.data
    assert start % arena.HUGE == 0
    huge_kib, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(v, 16) for v in first.split("-"))
                inside = lo <= start < hi
            elif inside and line.startswith("AnonHugePages:"):
                huge_kib = int(line.split()[1])
    # advised regions are compacted for at fault time: some of the eight are huge pages
    assert huge_kib >= 2048


def _rss_file_kib() -> int:
    return _kib("RssFile", "/proc/self/status")


@glibc
def test_released_pages_leave_the_resident_set_and_read_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # What a copied matrix's file pages go through: out of the resident set (so the copy is
    # not counted twice), still readable from the page cache.
    path = tmp_path / "w.bin"
    want = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    want.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r")
    assert int(mapped.sum(dtype=np.uint64)) == int(want.sum(dtype=np.uint64))  # every page in
    before = _rss_file_kib()
    assert memory.release_pages(mapped[100 : 100 + (48 << 20)])
    assert before - _rss_file_kib() >= 40 << 10  # ~48 MiB of it, less the edge pages
    np.testing.assert_array_equal(mapped, want)
    assert not memory.release_pages(mapped[10:20])  # no whole page inside
    own = np.ones(1 << 20, np.uint8)
    assert not memory.release_pages(own) and own.all()  # the process's own memory: refused


@pytest.mark.parametrize(
    ("flags", "mode"), [(["--no-mmap"], "copy"), (["--weights", "map"], "map")],
    ids=["no-mmap", "map"],
)
def test_server_reads_its_weights_where_told(tmp_path, flags: list[str], mode: str) -> None:  # type: ignore[no-untyped-def]
    from models import smollm2_path

    from lmserve_core.gguf_file import GGUFFile

    with GGUFFile.open(smollm2_path()) as gguf:
        matrices = sum(t.nbytes for t in gguf.tensors.values() if len(t.shape) == 2)
    event = _serve_once(tmp_path, "weights", *flags)
    assert event["mode"] == mode and event["relaid_bytes"] == 0  # SmolLM2: Q4_1 and Q8_0
    where = "copied_bytes" if mode == "copy" else "mapped_bytes"
    assert event[where] == matrices
    assert event["copied_bytes"] + event["mapped_bytes"] == matrices
