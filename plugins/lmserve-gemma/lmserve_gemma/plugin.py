"""The Gemma family's hooks: registers the ``gemma`` backend (``gemma3``)."""

from __future__ import annotations

from importlib import resources
from typing import Any

from lmserve_core import hookimpl
from lmserve_core.backend import Capabilities, SamplingDefaults, ServerSettings
from lmserve_core.model import FamilyConventions

ARCHITECTURES = ("gemma3",)

# Google's recommended sampling for Gemma 3: temperature 1.0, top_k 64, top_p 0.95.
SAMPLING = SamplingDefaults(temperature=1.0, top_k=64, top_p=0.95, min_p=0.0, repeat_penalty=1.0)


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


def create_backend(model_path: str | None, settings: ServerSettings) -> Any:
    """Open the GGUF, build the forward pass of its architecture and wrap it in the generic
    chat path."""
    from lmserve_core.gguf_chat import GGUFChatBackend
    from lmserve_core.gguf_file import GGUFError, GGUFFile

    if model_path is None:
        raise FileNotFoundError("the gemma backend needs a model file (lmserve --backend gemma "
                                "model.gguf)")
    gguf = GGUFFile.open(model_path)
    arch = gguf.architecture
    if arch == "gemma3":
        from .model import Gemma3Model

        model: Any = Gemma3Model.load(gguf, n_threads=settings.threads, kv_type=settings.kv_type)
        conventions = gemma3_conventions()
    else:
        gguf.close()
        raise GGUFError(f"architecture {arch!r} is not served by the gemma family "
                        f"({', '.join(ARCHITECTURES)})")
    return GGUFChatBackend(
        name=arch, gguf=gguf, model=model, conventions=conventions, settings=settings
    )


@hookimpl
def register_backends(register: Any) -> None:
    """Register ``gemma`` for Gemma 3 GGUFs."""
    register(
        "gemma",
        create_backend,
        architectures=ARCHITECTURES,
        description="Gemma 3 GGUFs, e.g. gemma-3-270m ... 27b (text)",
    )
