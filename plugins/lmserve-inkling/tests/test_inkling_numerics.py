"""Inkling's forward pass against transformers' ``InklingForCausalLM`` (eager attention,
float32) on a tiny random checkpoint converted by lmserve_inkling.convert: the family
conformance suite's numerics and cache paths, then what is Inkling's own.

The tiny model has a window of 8 and relative extents of 8 (sliding) and 12 (global), so
every prompt runs past both; its first layer is dense, the others MoE (8 experts, top 2, 2
shared); its vocabulary is padded (344 of 384 rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lmserve_inkling.convert import convert  # noqa: E402
from lmserve_inkling.model import InklingModel  # noqa: E402
from lmserve_inkling.plugin import create_backend  # noqa: E402

from lmserve_core.gguf_file import GGUFFile  # noqa: E402
from lmserve_core.testing.conformance import FamilyConformance, Subject  # noqa: E402
from lmserve_core.testing.numerics import (  # noqa: E402
    f32_reference_path,  # noqa: F401 (an autouse fixture: f32 activations throughout)
)

pytestmark = pytest.mark.reference


class HFTokens:
    """The checkpoint's own tokenizer (``tokenizers``), as the suite asks for ids."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)


def half_precision_kv(hf: Any) -> contextlib.AbstractContextManager[None]:
    """The reference with its keys and values rounded as an f16 cache stores them: the keys
    after their convolution and norm, the values after their convolution."""

    def rounded(_module: Any, _inputs: Any, output: Any) -> Any:
        return output.to(torch.float16).to(output.dtype)

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        hooks = []
        for layer in hf.model.layers:
            hooks.append(layer.self_attn.k_norm.register_forward_hook(rounded))
            hooks.append(layer.self_attn.v_sconv.register_forward_hook(rounded))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    return ctx()


def decoded_reference(checkpoint: Path, gguf_path: Path, inkling_tiny: Any) -> Any:
    """The transformers model holding exactly the weights ``gguf_path`` stores (decoded),
    each mapped back through the converter's own naming."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from lmserve_inkling.convert import _gguf_tensors

    stored = {
        t.name: dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist())))
        for t in GGUFReader(gguf_path).tensors
    }
    hf = inkling_tiny.load_reference(checkpoint)
    sd = hf.state_dict()
    with torch.no_grad():
        for name, value in sd.items():
            parts = [stored[g] for g, _ in _gguf_tensors(name, value.numpy())]
            array = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
            value.copy_(torch.from_numpy(np.array(array, np.float32)).reshape(value.shape))
    return hf


@pytest.fixture(scope="session")
def subject(checkpoint: Path, gguf_f32: Path, inkling_tiny: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Subject:
    subjects: dict[str, Subject] = {}

    def of_type(outtype: str) -> Subject:
        if outtype not in subjects:
            path = (gguf_f32 if outtype == "f32" else
                    convert(checkpoint, tmp_path_factory.mktemp(outtype) / "t.gguf", outtype))
            gguf = GGUFFile.open(path)
            hf = decoded_reference(checkpoint, path, inkling_tiny)
            subjects[outtype] = Subject(
                path=str(path),
                load=lambda kv_type="f16", n_batch=256: InklingModel.load(
                    gguf, n_threads=2, kv_type=kv_type, n_batch=n_batch
                ),
                hf=hf,
                tokenizer=HFTokens(checkpoint),
                rounding=lambda kv: (half_precision_kv(hf) if kv == "f16"
                                     else contextlib.nullcontext()),
                create_backend=create_backend,
                of_type=of_type,
            )
        return subjects[outtype]

    return of_type("f32")


class TestInklingConformance(FamilyConformance):
    """The suite's numerics, cache paths and served checks."""


def test_padded_vocabulary_is_left_out(subject: Subject) -> None:
    model = subject.model("f32")
    assert model.n_vocab == 344 and model.config.n_vocab == 384
    ids = subject.ids(FamilyConformance.PROMPTS[2])
    assert subject.mine(ids, "f32").shape == (len(ids), 344)


def test_log_scaling_of_the_global_layers(inkling_tiny: Any, tmp_path: Path) -> None:
    # log_scaling_n_floor 4: from position 4 on, the global layer's queries and bias grow
    checkpoint = inkling_tiny.tiny_checkpoint(inkling_tiny.TinyInkling(log_scaling_n_floor=4))
    path = convert(checkpoint, tmp_path / "log.gguf")
    model = InklingModel.load(GGUFFile.open(path), n_threads=2, kv_type="f32")
    assert model.config.log_n_floor == 4
    ids = HFTokens(checkpoint).encode(FamilyConformance.PROMPTS[2])
    got = model.forward(model.new_cache(len(ids)), ids, 0, all_logits=True)
    with torch.no_grad():
        want = inkling_tiny.load_reference(checkpoint)(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(got - want).max())
    print(f"log scaling: max |diff| {diff:.3g}")
    assert diff <= FamilyConformance.LOGIT_ATOL["f32"]
