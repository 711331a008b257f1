"""The fleet router's bookkeeping, with a model whose embedding is a keyword's direction: one
prefix object per selection, selections filled to ``docs`` documents, sticky conversations,
raw prompts retrieved each time, the cartridge LRU, and fleets that do not fit refused.
The real model's routing is tests/test_real_fleet.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmserve_core.cartridge import Cartridge, CartridgeError, write_cartridge
from lmserve_core.cartridge import route as R
from lmserve_core.cartridge.fleet import EMBED_SUFFIX, FLEET_FORMAT, Fleet, FleetIndex
from lmserve_core.request import Message

TOPICS = ["apple", "boat", "cloud", "drum"]
DIM = 8
LAYERS = [(2, 4, 4, 0, 0)] * 3


class Tokens:
    add_bos = False
    bos_id = None

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [ord(c) for c in text]


class Model:
    """Embeds a text as the sum of the directions of the topics it names."""

    serves_prefix_rows = True
    cache_layers = LAYERS
    n_embd = DIM

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, ids: list[int]) -> np.ndarray:
        self.calls += 1
        text = "".join(map(chr, ids)).removesuffix(EMBED_SUFFIX)
        v = np.full(DIM, 0.01, np.float32)
        for i, t in enumerate(TOPICS):
            v[i] += text.count(t)
        return v


def make_fleet(tmp: Path, p: int = 3, bad_p: int | None = None) -> Fleet:
    docs = []
    for i, t in enumerate(TOPICS):
        rows = bad_p if (bad_p and i == 3) else p
        k = [np.full((rows, h, d), i + 1, np.float32) for h, d, _, _, _ in LAYERS]
        write_cartridge(tmp / f"doc-{i:03d}.safetensors", Cartridge(k=k, v=[a * 2 for a in k]))
        docs.append({"name": f"{t}.md", "cart_file": f"doc-{i:03d}.safetensors", "tokens": 9})
    vectors = [Model().embed(Tokens().encode(t)) for t in TOPICS]
    FleetIndex.build(vectors, list(range(len(TOPICS)))).save(tmp / "index.safetensors")
    (tmp / "fleet.json").write_text(json.dumps({"format": FLEET_FORMAT, "p": p, "docs": docs}))
    return Fleet.open(tmp)


def user(*texts: str) -> list[Message]:
    out = []
    for t in texts:
        out += [Message("user", t), Message("assistant", "ok")]
    return out[:-1]


def test_a_selection_is_one_prefix_of_k_documents(tmp_path: Path) -> None:
    router = R.FleetRouter(make_fleet(tmp_path), Model(), Tokens(), docs=2, chunks=1)
    assert router.rows == 6 and router.default.p == 6
    first = router.select(user("tell me about the boat"))
    # one chunk scanned names one document: the next of the fleet fills the second place
    assert first.docs == (1, 0) and first.how == "retrieved" and len(first.scores) == 1
    assert first.prefix.p == 6 and first.prefix.k[0][0, 0] == 2 and first.prefix.k[0][3, 0] == 1
    again = router.select(user("tell me about the boat"))
    assert again.prefix is first.prefix  # the slot pool lends rows between them


def test_conversations_are_sticky_and_prompts_are_not(tmp_path: Path) -> None:
    model = Model()
    router = R.FleetRouter(make_fleet(tmp_path), model, Tokens())
    assert router.select(user("the apple")).docs == (0,)
    calls = model.calls
    later = router.select(user("the apple", "now the drum, the drum, the drum"))
    assert (later.how, later.docs, model.calls) == ("kept", (0,), calls)  # no retrieval
    assert router.select(user("the drum")).docs == (3,)  # another first message
    assert router.select([], "a cloud").docs == (2,)
    assert router.select([], "a cloud").how == "retrieved" and model.calls == calls + 3
    # with no user message, the conversation is retrieved by what there is
    assert router.select([Message("system", "boat")]).docs == (1,)


def test_adaptive_moves_only_past_the_margin(tmp_path: Path) -> None:
    router = R.FleetRouter(make_fleet(tmp_path), Model(), Tokens(), adaptive=True, margin=0.05)
    router.select(user("apple"))
    # apple and boat named alike: boat does not beat apple by the margin
    assert router.select(user("apple", "boat")).how == "stayed"
    moved = router.select(user("apple", "boat boat boat boat"))
    assert (moved.how, moved.docs) == ("switched", (1,))
    # the move is remembered: the conversation now stays with the boat
    assert router.select(user("apple", "boat boat boat boat", "ok")).docs == (1,)
    strict = R.FleetRouter(router.fleet, Model(), Tokens(), adaptive=True, margin=2.0)
    strict.select(user("apple"))
    assert strict.select(user("apple", "boat boat boat boat")).how == "stayed"


def test_cartridges_leave_the_lru_without_touching_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(R, "CARTRIDGES_KEPT", 2)
    router = R.FleetRouter(make_fleet(tmp_path), Model(), Tokens())
    held = [router.select(user(t)).prefix for t in TOPICS]
    assert len(router._cartridges) == 2
    assert [p.k[1][0, 0] for p in held] == [1, 2, 3, 4]
    assert router.select(user("apple")).prefix is held[0]  # still held: the same object


def test_fleets_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    class Wide(Model):
        n_embd = DIM * 2

    with pytest.raises(CartridgeError, match="another model"):
        R.FleetRouter(make_fleet(tmp_path), Wide(), Tokens())

    class Recurrent(Model):
        cache_layers = [(0, 0, 0, 0, 16)]

    with pytest.raises(CartridgeError, match="recurrent"):
        R.FleetRouter(make_fleet(tmp_path), Recurrent(), Tokens())

    class Other(Model):
        cache_layers = [(2, 4, 4, 0, 0)] * 2 + [(1, 4, 4, 0, 0)]

    with pytest.raises(CartridgeError):
        R.FleetRouter(make_fleet(tmp_path), Other(), Tokens())

    odd = tmp_path / "odd"
    odd.mkdir()
    router = R.FleetRouter(make_fleet(odd, bad_p=5), Model(), Tokens())
    with pytest.raises(CartridgeError, match="5 rows"):
        router.select(user("drum"))


def test_bad_options(tmp_path: Path) -> None:
    fleet: Any = make_fleet(tmp_path)
    with pytest.raises(ValueError):
        R.FleetRouter(fleet, Model(), Tokens(), docs=0)
    assert R.FleetRouter(fleet, Model(), Tokens(), docs=9).k == len(TOPICS)


def test_a_backend_that_serves_no_prefix_refuses_a_fleet(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    make_fleet(tmp_path)
    tests = str(Path(__file__).parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tests, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "lmserve_core", "--plugin", "fake_backend", "--backend",
         "scripted", "--fleet", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 2
    assert "--fleet: the scripted backend does not serve cartridges" in done.stderr
