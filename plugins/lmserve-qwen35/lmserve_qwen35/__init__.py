"""lmserve model family for hybrid recurrent Qwen models: Qwen3.5 (``qwen35``), Qwen3.5-MoE
(``qwen35moe``) and Qwen3-Next (``qwen3next``) GGUFs."""

__version__ = "0.1.0"
