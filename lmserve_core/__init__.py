"""lmserve: GGUF language models behind the OpenAI and Anthropic APIs."""

from .hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
