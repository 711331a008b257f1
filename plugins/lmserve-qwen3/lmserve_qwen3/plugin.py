"""The Qwen3 family's hooks: registers the ``qwen3`` and ``qwen3moe`` backends."""

from __future__ import annotations

from typing import Any

from lmserve_core import hookimpl
from lmserve_core.backend import Capabilities, SamplingDefaults, ServerSettings, ThinkMarkers
from lmserve_core.model import FamilyConventions
from lmserve_core.tools import HERMES

CAPABILITIES = Capabilities(
    grammar=True, reasoning=True, tools=HERMES, stop_strings=True, system_role=True
)
# Qwen's model card: thinking temperature 0.6, top_k 20, top_p 0.95; non-thinking 0.7 / 20 /
# 0.8; min_p 0 in both.
SAMPLING = SamplingDefaults(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, repeat_penalty=1.0)
THINKING_SAMPLING = SamplingDefaults(
    temperature=0.6, top_k=20, top_p=0.95, min_p=0.0, repeat_penalty=1.0
)
CONVENTIONS = FamilyConventions(
    capabilities=CAPABILITIES,
    sampling=SAMPLING,
    thinking_sampling=THINKING_SAMPLING,
    think=ThinkMarkers("<think>", "</think>"),
    # <|im_end|> and <|endoftext|> end a turn: the vocabulary marks both as end of generation
    extra_stop_tokens=("<|im_end|>", "<|endoftext|>"),
    thinking_switch="enable_thinking",  # the variable Qwen3's chat template reads
)


def create_backend(model_path: str | None, settings: ServerSettings) -> Any:
    """Open the GGUF, build the Qwen3 forward pass and wrap it in the generic chat path."""
    from lmserve_core.gguf_chat import GGUFChatBackend
    from lmserve_core.gguf_file import GGUFFile

    from .model import Qwen3Model

    if model_path is None:
        raise FileNotFoundError("the qwen3 backend needs a model file (lmserve --backend qwen3 "
                                "model.gguf)")
    gguf = GGUFFile.open(model_path)
    model = Qwen3Model.load(gguf, n_threads=settings.threads, kv_type=settings.kv_type)
    return GGUFChatBackend(
        name=gguf.architecture, gguf=gguf, model=model, conventions=CONVENTIONS, settings=settings
    )


@hookimpl
def register_backends(register: Any) -> None:
    """Register ``qwen3`` (dense) and ``qwen3moe``; either name serves either file."""
    register(
        "qwen3",
        create_backend,
        architectures=("qwen3",),
        description="Qwen3 GGUFs (dense), e.g. Qwen3-0.6B ... 32B",
    )
    register(
        "qwen3moe",
        create_backend,
        architectures=("qwen3moe",),
        description="Qwen3-MoE GGUFs (mixture of experts), e.g. Qwen3-30B-A3B",
    )
