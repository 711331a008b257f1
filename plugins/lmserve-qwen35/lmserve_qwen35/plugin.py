"""The Qwen3.5 family's hooks: registers the ``qwen35`` backend (``qwen35``, ``qwen35moe``
and ``qwen3next`` GGUFs)."""

from __future__ import annotations

from lmserve_core.backend import Capabilities, SamplingDefaults, ThinkMarkers
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit.family import BackendSpec, Family
from lmserve_core.model import FamilyConventions
from lmserve_core.tools import HERMES, ToolConvention

from .config import ARCHITECTURES

# Qwen's model cards: thinking temperature 0.6, top_k 20, top_p 0.95; non-thinking 0.7 / 20 /
# 0.8; min_p 0 in both. A file's general.sampling.* keys take precedence.
SAMPLING = SamplingDefaults(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, repeat_penalty=1.0)
THINKING_SAMPLING = SamplingDefaults(
    temperature=0.6, top_k=20, top_p=0.95, min_p=0.0, repeat_penalty=1.0
)


def tool_convention(template: str) -> ToolConvention:
    """The notation the chat template teaches: Qwen3.5's XML form (``<function=NAME>`` with
    ``<parameter=...>`` children) or hermes JSON (Qwen3-Next)."""
    if "<function=" in template:
        from lmserve_core import tools

        xml = getattr(tools, "QWEN_XML", None)
        if xml is not None:
            return xml  # type: ignore[no-any-return]
    return HERMES


def conventions(gguf: GGUFFile) -> FamilyConventions:
    """The conventions of a file: its template picks the tool notation."""
    template = str(gguf.metadata.get("tokenizer.chat_template", "") or "")
    return FamilyConventions(
        capabilities=Capabilities(
            grammar=True,
            reasoning=True,
            tools=tool_convention(template),
            stop_strings=True,
            system_role=True,
        ),
        sampling=SAMPLING,
        thinking_sampling=THINKING_SAMPLING,
        think=ThinkMarkers("<think>", "</think>"),
        extra_stop_tokens=("<|im_end|>", "<|endoftext|>"),
        thinking_switch="enable_thinking",
    )


FAMILY = Family(
    "qwen35",
    model="lmserve_qwen35.model:Qwen35Model",
    conventions=conventions,
    backends=[
        BackendSpec(
            "qwen35",
            ARCHITECTURES,
            "Qwen3.5, Qwen3.5-MoE and Qwen3-Next GGUFs (DeltaNet + gated attention), e.g. "
            "Qwen3.5-0.8B ... 27B, Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B",
        )
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
