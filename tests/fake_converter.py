"""A converter plugin for ``lmserve convert`` tests: ``--plugin fake_converter`` registers
``FakeForCausalLM``, written as a GGUF of one f32 tensor and the checkpoint's keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter

from lmserve_core import hookimpl


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    config = json.loads((hf_dir / "config.json").read_text())
    writer = GGUFWriter(str(out), "fake")
    writer.add_uint32("fake.hidden_size", int(config["hidden_size"]))
    writer.add_string("fake.outtype", outtype)
    writer.add_tensor("token_embd.weight", np.zeros((2, config["hidden_size"]), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@hookimpl
def register_converters(register: Any) -> None:
    register("FakeForCausalLM", convert, description="a test converter")
