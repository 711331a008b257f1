"""lmserve model family for nanochat checkpoints: served as their trainers leave them."""

__version__ = "0.1.0"
