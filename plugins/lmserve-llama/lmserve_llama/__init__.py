"""lmserve model family for llama-architecture GGUFs (Llama 2/3, SmolLM2, Mistral)."""

__version__ = "0.1.0"
