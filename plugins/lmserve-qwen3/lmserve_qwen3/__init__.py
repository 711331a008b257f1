"""lmserve model family for Qwen3 (``qwen3``) and Qwen3-MoE (``qwen3moe``) GGUFs."""

__version__ = "0.1.0"
