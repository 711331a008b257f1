"""The KV disk tier with Gemma 3's sliding-window caches (rings of the window and a chunk):
a conversation longer than the window, spilled and restored, answers as if served cold."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lmserve_gemma import plugin

from lmserve_core.backend import ServerSettings
from lmserve_core.events import Finish, TextDelta
from lmserve_core.request import Message, NormalizedRequest, Sampling
from lmserve_core.settings import DiskSettings

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from models import gemma3_path  # noqa: E402

TEXT = ROOT / "tests" / "data" / "perplexity" / "text.txt"


class Sink:
    cancelled = False

    def __init__(self) -> None:
        self.text = ""

    def emit(self, event: Any) -> None:
        if isinstance(event, TextDelta):
            self.text += event.text


def ask(backend: Any, messages: list[Message]) -> tuple[str, Finish]:
    request = NormalizedRequest(id=str(len(messages)), dialect="chat", messages=messages,
                                sampling=Sampling(temperature=0.0), max_tokens=16)
    backend.validate(request)
    sink = Sink()
    finish = backend.generate(request, sink)
    return sink.text, finish


def test_a_window_cache_spilled_and_restored_answers_as_cold(tmp_path: Path) -> None:
    document = TEXT.read_text(encoding="utf-8")[:4000]
    first = [Message("user", f"{document}\n\nWhat is this text about? One sentence.")]

    def backend(directory: str | None = None) -> Any:
        settings = ServerSettings(ctx=2048, threads=2, kv_slots=1, batch=1,
                                  disk=DiskSettings(directory=directory))
        return plugin.create_backend(str(gemma3_path()), settings)

    served = backend(str(tmp_path))
    try:
        reply, finish = ask(served, first)
        assert finish.usage.prompt_tokens > 800  # past the 512-position window
        follow = [*first, Message("assistant", reply), Message("user", "Name one danger.")]
        ask(served, [Message("user", "Hi")])  # evicts the conversation: spilled
        warm, warm_finish = ask(served, follow)
        assert served.slots.last_tier == "disk"
        assert warm_finish.usage.cached_tokens > 800
    finally:
        served.close()
    cold_backend = backend()
    try:
        cold, cold_finish = ask(cold_backend, follow)
    finally:
        cold_backend.close()
    assert cold_finish.usage.cached_tokens == 0
    assert warm == cold and warm
