"""The Inkling family's hooks: registers the ``inkling`` backend and its converter.

The conventions are those of Inkling's wire format (:mod:`.inkling_tools`): a chat template
of blocks (the file's own, else ``templates/inkling.jinja``), the leading
``<|content_thinking|>`` block routed to the reasoning channel, the other blocks read out of
the reply (text without its markers, ``NAME<|content_invoke_tool_json|>{...}`` as calls),
``<|content_model_end_sampling|>`` ending the turn (``<|end_message|>`` ends a block only).
"""

from __future__ import annotations

from importlib import resources

from lmserve_core.backend import Capabilities, SamplingDefaults, ThinkMarkers
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.kit.family import BackendSpec, Converter, Family
from lmserve_core.model import FamilyConventions

from .config import ARCHITECTURES
from .inkling_tools import END, END_SAMPLING, INKLING_BLOCKS, INKLING_TOOLS, MARKERS, THINKING

EOS = END_SAMPLING
CAPABILITIES = Capabilities(
    grammar=True, reasoning=True, tools=INKLING_TOOLS, stop_strings=True, system_role=True
)
SAMPLING = SamplingDefaults(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)


def fallback_template() -> str:
    """The wire format's chat template, for files that carry none."""
    return resources.files(__package__).joinpath("templates", "inkling.jinja").read_text("utf-8")


def conventions(gguf: GGUFFile | None = None) -> FamilyConventions:
    """Inkling's wire format; thinking is switched by ``enable_thinking`` (effort 0.9 or 0 in
    the template's system block; a ``reasoning_effort`` number among the template's
    arguments sets it)."""
    return FamilyConventions(
        capabilities=CAPABILITIES,
        sampling=SAMPLING,
        think=ThinkMarkers(THINKING, END),
        extra_stop_tokens=(EOS,),
        fallback_template=fallback_template(),
        thinking_switch="enable_thinking",
        shown_tokens=MARKERS,
        reply_reader=INKLING_BLOCKS,
    )


FAMILY = Family(
    "inkling",
    model="lmserve_inkling.model:InklingModel",
    conventions=conventions,
    backends=[
        BackendSpec("inkling", ARCHITECTURES, "Inkling GGUFs (Thinking Machines' text model)")
    ],
    converters=[
        Converter("InklingForCausalLM", "lmserve_inkling.convert:convert",
                  "Inkling (text) to an inkling GGUF")
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
register_converters = FAMILY.register_converters
