"""Cartridge training and fleets on real SmolLM2-135M-Instruct: the torch copy the trainer
runs leaves the same K/V rows as lmserve's own cache (keys re-permuted to the file's order),
a few self-study steps write a trained cartridge that resumes and serves through lmserve's
engine, and a fleet of three documents routes held-out questions to their documents. The
acceptance-sized run is examples/cartridge/experiment.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from lmserve_core.cartridge import read_cartridge  # noqa: E402
from lmserve_core.cartridge import train as T  # noqa: E402
from lmserve_core.cartridge.fleet import Fleet  # noqa: E402
from lmserve_core.cartridge.fleet_build import build_fleet  # noqa: E402
from lmserve_core.cartridge.prefill import capture_rows  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cartridge"


@pytest.fixture(scope="module")
def model() -> Iterator[T.Model]:
    import torch
    from models import smollm2_path

    threads = torch.get_num_threads()
    m = T.Model.load(smollm2_path(), threads=1)
    yield m
    m.close()
    torch.set_num_threads(threads)


def test_torch_rows_are_the_cache_rows(model: T.Model) -> None:
    text = (EXAMPLE / "corpus" / "zorvania.md").read_text()
    ids = T.prefill_ids(model, text, 24)
    k, v = capture_rows(model.backend.model, ids, "f32")
    mine = model.lm.to_cartridge(*model.lm.prefill(ids), {})
    # the engine's quantised products against dequantised float32: agreement to ~1e-4 of the
    # rows' scale (a key pair in the wrong order would be off by the scale itself)
    for layer in (0, 14, 29):
        for got, want in ((mine.k[layer], k[layer]), (mine.v[layer], v[layer])):
            assert np.abs(got - want).max() < 1e-3 * float(np.abs(want).max())


def test_train_resume_and_serve(model: T.Model, tmp_path: Path) -> None:
    text = (EXAMPLE / "corpus" / "zorvania.md").read_text()
    cfg = T.TrainConfig(p=16, steps=2, accum=1, conversations=2, holdout=1, chunk_min=32,
                        chunk_max=64, max_q=24, max_a=24, lr=1e-2, save_every=1)
    out = tmp_path / "z.safetensors"
    r = T.build_trained(model, text, out, cfg, say=lambda s: None)
    assert r.steps == 2 and r.conversations == 2 and len(r.losses) == 2
    with pytest.raises(FileExistsError, match="--resume"):
        T.build_trained(model, text, out, cfg)
    cfg.steps = 3
    said: list[str] = []
    r = T.build_trained(model, text, out, cfg, resume=True, say=said.append)
    assert said == ["resumed at step 2 of 3"] and r.steps == 3 and len(r.losses) == 3
    cart = read_cartridge(out)
    assert cart.p == 16 and cart.metadata["init"] == "trained" and cart.metadata["architecture"] == "llama"
    start = T.prefill_cartridge(model, text, 16)
    assert np.array_equal(cart.k[0][0], start.k[0][0])  # the sink stays
    assert not np.array_equal(cart.k[5][1:], start.k[5][1:])  # the rest trained
    # served through lmserve's engine behind the cartridge, as --cartridge serves it
    reply = T.answers(model, ["What is the capital city of Zorvania?"], cart, max_new=12)[0]
    assert reply.strip()


def test_fleet_routes_questions(model: T.Model, tmp_path: Path) -> None:
    cfg = T.TrainConfig(p=16)
    fleet = build_fleet(model, EXAMPLE / "corpus", tmp_path / "fleet", cfg, init="prefill",
                        say=lambda s: None)
    assert [d.name for d in fleet.docs] == ["quillfish.md", "velmora.md", "zorvania.md"]
    assert fleet.index.embeddings.shape == (3, 576)
    again = Fleet.open(tmp_path / "fleet")
    assert np.array_equal(again.index.centroid, fleet.index.centroid)
    rows = json.loads((EXAMPLE / "questions.json").read_text())
    names = [Path(d.name).stem for d in fleet.docs]
    routed = sum(
        names[fleet.select(model.lm.embed, model.tokenizer, r["question"])[0][0]] == r["doc"]
        for r in rows
    )
    assert routed >= 24, f"{routed}/{len(rows)} questions routed to their document"
