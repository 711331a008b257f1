"""lmserve model family for Gemma 3 (``gemma3``) and Gemma 4 (``gemma4``) GGUFs."""

__version__ = "0.1.0"
