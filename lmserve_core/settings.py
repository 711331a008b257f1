"""What the command line asks of a backend, as typed objects: :class:`ServerSettings` and
the parts a part of the engine reads (the disk tier, speculation, prefixes). Backend
factories get one ``ServerSettings``; a family's own options arrive typed in ``options``
(``BackendSpec.options``, filled from the flags its plugin registered)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# at run time too: the server's handlers take ServerSettings, whose hints are resolved
from .cartridge.file import Cartridge
from .cartridge.fleet import Fleet

#: ``ServerSettings.kv_slots`` for ``--kv-slots auto``: as many as a share of memory holds.
AUTO_SLOTS = 0
DISK_MAX_FILES = 64  # --kv-disk-slots' default
DISK_MAX_GB = 8.0  # --kv-disk-max-gb's default


@dataclass(frozen=True, slots=True)
class DiskSettings:
    """``--kv-cache-dir``, ``--kv-disk-slots``, ``--kv-disk-max-gb``."""

    directory: str | None = None  # None: no disk tier
    max_files: int = DISK_MAX_FILES
    max_gb: float = DISK_MAX_GB


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    """``--spec`` (drafts from the conversation itself) and ``--spec-draft`` (a model)."""

    prompt_lookup: bool = False
    draft: str | None = None  # a GGUF path


@dataclass(frozen=True, slots=True)
class RetrievalSettings:
    """How a fleet picks a conversation's documents (``--rag-*``)."""

    docs: int = 1
    chunks: int = 8
    adaptive: bool = False
    margin: float = 0.05


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """Rows every conversation starts behind: one cartridge, or a fleet's per conversation."""

    cartridge: Cartridge | None = None
    fleet: Fleet | None = None
    retrieval: RetrievalSettings = field(default_factory=RetrievalSettings)


@dataclass(slots=True)
class ServerSettings:
    """The command-line settings a backend factory may need."""

    ctx: int = 4096
    threads: int = 0  # 0: all cores
    kv_slots: int = 1  # AUTO_SLOTS: sized from the available memory
    kv_type: str = "f16"  # KV cache storage: "f16" or "f32"
    batch: int = 4  # requests generated together (batching backends)
    seed: int | None = None
    model_id: str | None = None  # --model-id: what /v1/models reports
    kv_slots_force: bool = False  # keep kv_slots even where the RAM guard would clamp them
    available_memory: int | None = None  # bytes the RAM guard plans with; None: the system's
    disk: DiskSettings = field(default_factory=DiskSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    prefixes: PrefixSettings = field(default_factory=PrefixSettings)
    options: Any = None  # the backend's own options: an instance of its BackendSpec.options
