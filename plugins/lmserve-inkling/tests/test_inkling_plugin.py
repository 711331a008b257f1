"""The plugin: its entry point's backend, the config read from a converted file, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmserve_inkling import plugin
from lmserve_inkling.config import InklingConfig

from lmserve_core.gguf_file import GGUFError, GGUFFile


def test_backend_is_registered_for_the_architecture() -> None:
    spec = plugin.FAMILY.backends[0]
    assert spec.name == "inkling" and "inkling" in spec.architectures
    conv = plugin.conventions(None)  # type: ignore[arg-type]
    assert "<|content_model_end_sampling|>" in conv.extra_stop_tokens


def test_config_from_a_converted_file(gguf_f32: Path) -> None:
    c = InklingConfig.from_gguf(GGUFFile.open(gguf_f32))
    assert c.kv_heads == (2, 2, 1, 2) and c.swa == (True, True, False, True)
    assert (c.window, c.rel_extent, c.rel_extent_swa, c.d_rel, c.conv_kernel) == (8, 12, 8, 4, 4)
    assert (c.n_dense, c.n_expert, c.n_expert_used, c.n_shared, c.n_ff_exp) == (1, 8, 2, 2, 32)
    assert c.n_vocab == 384 and c.n_vocab_unpadded == 344 and c.logit_scale_denom == 4.0


def test_a_bank_of_the_wrong_extent_is_refused(gguf_f32: Path, tmp_path: Path) -> None:
    # the sliding-window pattern read the wrong way round: the banks' widths disagree
    from gguf import GGUFReader, GGUFWriter
    from lmserve_inkling.model import InklingModel

    from lmserve_core.testing.gguf_writer import add_values

    src = GGUFReader(gguf_f32)
    out = tmp_path / "swapped.gguf"
    w = GGUFWriter(str(out), "inkling")
    keys = {k: f.contents() for k, f in src.fields.items()
            if not k.startswith("GGUF.") and k != "general.architecture"}
    pattern = "inkling.attention.sliding_window_pattern"
    keys[pattern] = [not v for v in keys[pattern]]
    add_values(w, keys)
    for t in src.tensors:
        w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="attn_rel_proj|head"):
        InklingModel.load(GGUFFile.open(out), n_threads=1)
