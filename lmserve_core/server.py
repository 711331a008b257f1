"""The objects one serving process shares between its handlers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from litestar.di import NamedDependency

from .backend import Backend, ServerSettings
from .embeddings import Embedder
from .engine import Engine


@dataclass(slots=True)
class Server:
    """Injected into every handler as ``server``."""

    engine: Engine
    settings: ServerSettings
    api_key: str | None = None
    embedder: Embedder | None = None  # /v1/embeddings and /v1/rerank (None: not served)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def backend(self) -> Backend:
        return self.engine.backend

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    @property
    def ctx(self) -> int:
        return self.backend.context_length


# How handlers ask for the shared Server (provided as ``server`` by the app).
ServerDep = NamedDependency[Server]
