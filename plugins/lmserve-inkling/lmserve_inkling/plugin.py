"""The Inkling family's hooks: registers the ``inkling`` backend.

The chat conventions (the wire format's template, thinking routed from
``<|content_thinking|>``, the JSON tool invocation) are not in yet: a file is served with its
own chat template and ``<|content_model_end_sampling|>`` ends a turn.
"""

from __future__ import annotations

from lmserve_core.backend import Capabilities, SamplingDefaults
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit.family import BackendSpec, Family
from lmserve_core.model import FamilyConventions

from .config import ARCHITECTURES

EOS = "<|content_model_end_sampling|>"
CAPABILITIES = Capabilities(grammar=True, reasoning=False, stop_strings=True, system_role=True)
SAMPLING = SamplingDefaults(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)


def conventions(gguf: GGUFFile) -> FamilyConventions:
    """The end-of-turn token; the rest as llama.cpp's defaults."""
    return FamilyConventions(
        capabilities=CAPABILITIES, sampling=SAMPLING, extra_stop_tokens=(EOS,)
    )


FAMILY = Family(
    "inkling",
    model="lmserve_inkling.model:InklingModel",
    conventions=conventions,
    backends=[
        BackendSpec("inkling", ARCHITECTURES, "Inkling GGUFs (Thinking Machines' text model)")
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
