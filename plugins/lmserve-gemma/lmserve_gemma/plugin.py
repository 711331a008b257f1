"""The Gemma family's hooks: registers the ``gemma`` backend (``gemma3``, ``gemma4`` and
DiffusionGemma's ``diffusion-gemma``)."""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

from lmserve_core.backend import Capabilities, SamplingDefaults, ThinkMarkers
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit.family import BackendSpec, Converter, Family
from lmserve_core.model import FamilyConventions

from .gemma4_tools import GEMMA4_TOOLS

ARCHITECTURES = ("gemma3", "gemma4", "diffusion-gemma")

# Google's recommended sampling for Gemma 3 and Gemma 4 (thinking or not): temperature 1.0,
# top_k 64, top_p 0.95.
SAMPLING = SamplingDefaults(temperature=1.0, top_k=64, top_p=0.95, min_p=0.0, repeat_penalty=1.0)

# Gemma 4's turn markers: the template closes a turn with "<turn|>\n" and opens the model's
# with "<|turn>model\n".
GEMMA4_TURN_END = "<turn|>\n"
GEMMA4_MODEL_TURN = "<|turn>model\n"


def fallback_template(name: str) -> str:
    """A chat template shipped with the family (``templates/{name}.jinja``)."""
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text("utf-8")


def gemma3_conventions() -> FamilyConventions:
    """Gemma 3: ``<start_of_turn>user … <end_of_turn>`` turns, the system text folded into
    the first user turn by the template; no tool convention of its own (forced calls go
    through the generic grammar path) and no reasoning channel."""
    return FamilyConventions(
        capabilities=Capabilities(
            grammar=True, reasoning=False, tools=None, stop_strings=True, system_role=True
        ),
        sampling=SAMPLING,
        # <end_of_turn> ends a turn; <eos> ends the text
        extra_stop_tokens=("<end_of_turn>", "<eos>"),
        fallback_template=fallback_template("gemma3"),
    )


def open_model_turn(prompt: str) -> str:
    """A Gemma 4 prompt ending at a closed turn opens the model's turn.

    Gemma 4's template renders the text of an assistant turn that called tools after the
    tools' results and closes that turn; with nothing after it, it opens no new model turn
    (nor for add_generation_prompt). llama.cpp then appends ``<|turn>model\n`` (its Gemma 4
    chat handler), and so does this."""
    return prompt + GEMMA4_MODEL_TURN if prompt.endswith(GEMMA4_TURN_END) else prompt


def gemma4_conventions() -> FamilyConventions:
    """Gemma 4: ``<|turn>user … <turn|>`` turns, a system turn of its own, tool declarations,
    calls and results in the template's notation (:mod:`.gemma4_tools`), a reasoning channel
    ``<|channel>thought … <channel|>`` switched by ``enable_thinking``."""
    return FamilyConventions(
        capabilities=Capabilities(
            grammar=True, reasoning=True, tools=GEMMA4_TOOLS, stop_strings=True, system_role=True
        ),
        sampling=SAMPLING,
        think=ThinkMarkers("<|channel>thought", "<channel|>"),
        # <turn|> ends a turn, <|tool_response> ends the model's turn after its calls (the
        # server writes the results), <eos> ends the text: llama.cpp's end-of-generation set
        extra_stop_tokens=("<turn|>", "<|tool_response>", "<eos>"),
        thinking_switch="enable_thinking",
        finish_prompt=open_model_turn,
    )


def diffusion_gemma_conventions() -> FamilyConventions:
    """DiffusionGemma: Gemma 4's turns and reasoning channel; tools and output constraints
    are a 400 naming the field (the reference has neither)."""
    g4 = gemma4_conventions()
    caps = replace(
        g4.capabilities, grammar=False, tools=None,
        refuses_tools="DiffusionGemma writes a block at a time: no tool calls or output "
        "constraints",
    )
    return replace(g4, capabilities=caps)


def conventions(gguf: GGUFFile) -> FamilyConventions:
    """The conventions of the file's architecture."""
    if gguf.architecture == "diffusion-gemma":
        return diffusion_gemma_conventions()
    return gemma4_conventions() if gguf.architecture == "gemma4" else gemma3_conventions()


FAMILY = Family(
    "gemma",
    model={
        "gemma3": "lmserve_gemma.model:Gemma3Model",
        "gemma4": "lmserve_gemma.gemma4_model:Gemma4Model",
        "diffusion-gemma": "lmserve_gemma.dgemma_model:DiffusionGemmaModel",
    },
    chat={"diffusion-gemma": "lmserve_gemma.dgemma_backend:DiffusionChatBackend"},
    converters=[
        Converter(
            "DiffusionGemmaForBlockDiffusion", "lmserve_gemma.convert_diffusion:convert",
            "DiffusionGemma (text) to a diffusion-gemma GGUF",
        )
    ],
    conventions=conventions,
    backends=[
        BackendSpec(
            "gemma",
            ARCHITECTURES,
            "Gemma 3, Gemma 4 and DiffusionGemma GGUFs (text), e.g. gemma-3-270m ... 27b, "
            "gemma-4-E2B ... 31B, 26B-A4B, diffusiongemma-26B-A4B",
        )
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
register_converters = FAMILY.register_converters
