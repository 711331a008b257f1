"""The C heap settings of the server process (glibc)."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from lmserve_core import memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


def _anon_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise AssertionError("no Anonymous line")


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


def test_available_memory_is_read_from_the_system() -> None:
    from lmserve_core.memory import available

    avail = available()
    assert avail is None or avail > 2**20


@pytest.mark.parametrize(
    ("available", "force", "slots", "batch"),
    [(None, False, 4, 4), (12 * 2**20, False, 4, 4), (7 * 2**20, False, 1, 1),
     (7 * 2**20, True, 4, 4)],
)
def test_backend_keeps_the_slots_the_guard_allows(
    available: int | None, force: bool, slots: int, batch: int, capsys: pytest.CaptureFixture[str]
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

    extra: dict[str, object] = {"kv_slots_force": force}
    if available is not None:
        extra["available_memory"] = available
    backend = GGUFChatBackend(
        name="fake", gguf=GGUFFile.open(smollm2_path()), model=Priced(49152),  # type: ignore[arg-type]
        conventions=FamilyConventions(),
        settings=ServerSettings(ctx=2048, kv_slots=1, batch=4, extra=extra),
    )
    assert len(backend.slots.slots) == slots and backend.batch_size == batch
    out = capsys.readouterr().out
    assert "kv_memory" in out and "bytes_per_slot" in out
    if slots < 4:
        assert "clamped" in out
    elif available is not None and available < 16 * 2**20:
        assert "more than half" in out


def test_server_keeps_the_slots_that_fit_in_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A real server asked for more KV slots than the machine's memory holds starts with the
    # slots that fit in half of it, says so, and serves.
    import json

    import httpx
    from models import smollm2_path
    from processes import API_KEY, launch

    from lmserve_core.memory import available

    avail = available()
    if avail is None:
        pytest.skip("the system does not report its available memory")
    # SmolLM2 at 8192 positions: 30 layers of 3 kv heads of 64 f16 keys and values a position
    per_slot = 8192 * 30 * 2 * 3 * 64 * 2
    wanted = 2 * avail // per_slot + 2
    running = launch(str(smollm2_path()), "--ctx", "8192", "--threads", "2", "--kv-slots",
                     str(wanted), scripted=False, log_dir=tmp_path, timeout=120)
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
    event = next(e for e in events if e.get("event") == "kv_memory")
    assert event["verdict"] == "clamped" and event["bytes_per_slot"] == per_slot
    assert event["slots"] == wanted
    kept, seen = event["kept_slots"], event["available_bytes"]
    assert 1 <= kept < wanted and kept * per_slot <= seen // 2 < (kept + 1) * per_slot
