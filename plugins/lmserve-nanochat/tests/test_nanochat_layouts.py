"""Each layout a nanochat model comes in, read from disk by the plugin's own path
(``open_checkpoint``: the reader, the tokenizer, the view) and run by ``NanochatModel``: the
logits of every position equal the reference forward of the model that was saved."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tiktoken")
pytest.importorskip("rustbpe")

from lmserve_nanochat.model import NanochatModel  # noqa: E402
from lmserve_nanochat.plugin import Options, open_checkpoint  # noqa: E402
from runs import native_run  # noqa: E402
from tiny_nanochat import SPECS, native_config, tiny_model  # noqa: E402
from vocab_fixtures import VOCAB_SIZE, corpus, encoding, write_tokenizer_bin, write_tokenizer_json  # noqa: E402

from lmserve_core.backend import ServerSettings  # noqa: E402

ATOL = 2e-4  # of max |logit|, as the forward tests


def served_logits(path: Path, ids: list[int]) -> np.ndarray:
    view = open_checkpoint(str(path), ServerSettings(ctx=256, options=Options(load_type="f32")))
    model = NanochatModel.load(view, n_threads=2, kv_type="f32")
    try:
        return model.forward(model.new_cache(len(ids) + 1), ids, 0, all_logits=True)
    finally:
        model.close()


def prompt() -> list[int]:
    enc = encoding()
    return enc.encode_ordinary(" ".join(corpus(seed=3, n=12)))[:120]


def check(path: Path, reference: Any) -> None:
    ids = prompt()
    want = reference.logits(ids)
    got = served_logits(path, ids)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= ATOL * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_native_run(tmp_path: Path) -> None:
    base, model = native_run("smear")
    check(base, model)


def test_safetensors_and_tokenizer_bin(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    model = tiny_model("smear", replace(SPECS["smear"], vocab_size=VOCAB_SIZE))
    run = tmp_path / "run"
    run.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in model.tensors.items()},
              run / "model.safetensors")
    write_tokenizer_bin(run / "tokenizer.bin")
    # the config beside it: the windows of a model trained with them are not in its shapes
    (run / "model.config.json").write_text(json.dumps(native_config(model.spec)))
    check(run, model)


def test_hugging_face_port(tmp_path: Path) -> None:
    model = tiny_model("hf", replace(SPECS["hf"], vocab_size=VOCAB_SIZE))
    run = tmp_path / "hf"
    model.reference.save_pretrained(run, safe_serialization=True)
    write_tokenizer_json(run / "tokenizer.json")
    assert json.loads((run / "config.json").read_text())["architectures"] == [
        "NanoChatForCausalLM"
    ]
    check(run, model)
