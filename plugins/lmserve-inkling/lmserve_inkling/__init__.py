"""lmserve model family for ``inkling`` GGUFs (Thinking Machines' Inkling text model)."""

__version__ = "0.1.0"
