"""The Qwen3 family's hooks: registers the ``qwen3`` and ``qwen3moe`` backends."""

from __future__ import annotations

from lmserve_core.backend import Capabilities, SamplingDefaults, ThinkMarkers
from lmserve_core.kit.family import BackendSpec, Family
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

# Either backend name serves either file.
FAMILY = Family(
    "qwen3",
    model="lmserve_qwen3.model:Qwen3Model",
    conventions=CONVENTIONS,
    backends=[
        BackendSpec("qwen3", ("qwen3",), "Qwen3 GGUFs (dense), e.g. Qwen3-0.6B ... 32B"),
        BackendSpec(
            "qwen3moe",
            ("qwen3moe",),
            "Qwen3-MoE GGUFs (mixture of experts), e.g. Qwen3-30B-A3B",
        ),
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
