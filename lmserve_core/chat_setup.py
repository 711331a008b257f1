"""Setting up a GGUF chat backend: what ``GGUFChatBackend.__init__`` wires before the first
request.

:func:`set_up` wraps the family's model in a ``--cartridge`` prefix or a ``--fleet`` of
document cartridges, reads the tokenizer and chat template from the GGUF metadata, applies
the file's recommended sampling (:func:`file_sampling`), sizes the KV slots (``--kv-slots``,
auto or given, held to the memory guard of :mod:`lmserve_core.memory`), opens the disk tier
(``--kv-cache-dir``) and loads the draft source of speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from . import memory
from .backend import AUTO_SLOTS, Capabilities, ServerSettings
from .cartridge.route import FleetRouter
from .cartridge.serve import PrefixRows, prefixed_model
from .chat_template import ChatTemplate
from .gguf_file import GGUFFile
from .kv_disk import DiskTier, model_fingerprint
from .kv_slots import SlotPool
from .model import CacheKind, FamilyConventions, ForwardModel, KVCache
from .speculative import DraftSource, draft_source
from .tokenizer import Tokenizer

log = structlog.get_logger("lmserve.gguf_chat")


@dataclass(eq=False)
class ChatSetup:
    """What :func:`set_up` wired: the backend's attributes of the same names."""

    model_id: str
    model: ForwardModel  # the family's, behind the cartridge or fleet prefix if any
    conventions: FamilyConventions  # with the file's sampling
    capabilities: Capabilities
    context_length: int
    tokenizer: Tokenizer
    template: ChatTemplate
    prefix: PrefixRows | None  # --cartridge: a KV prefix every cache starts with
    fleet: FleetRouter | None  # --fleet: each conversation behind its documents' cartridges
    vocab_size: int  # logit rows past the tokenizer's vocabulary are padding
    stop_ids: frozenset[int]
    shown_ids: frozenset[int]  # control tokens the reply's text keeps
    batch_size: int  # generations decoded together; each holds a slot while it runs
    kv_slots: int
    kv_bytes: int | None  # the KV memory the slots take at full context
    cache_kind: CacheKind
    slots: SlotPool[KVCache]
    drafts: DraftSource | None


def set_up(
    *,
    gguf: GGUFFile,
    model: ForwardModel,
    conventions: FamilyConventions,
    settings: ServerSettings,
    model_id: str | None = None,
    speculate: bool = True,
) -> ChatSetup:
    """Wire a backend's model, tokenizer, template, slots and drafts (none unless
    ``speculate``: a family that does not decode token by token has no use for them)."""
    model_id = model_id or gguf.model_id or Path(gguf.path).stem
    prefix: PrefixRows | None = None
    cartridge = settings.prefixes.cartridge
    if cartridge:
        wrapped = prefixed_model(model, cartridge, gguf, model_id)
        prefix = wrapped.prefix
        model = wrapped
    conventions = file_sampling(gguf, conventions)
    # the sampler biases logits by token id, and prompts may be token ids, on every family
    capabilities = replace(conventions.capabilities, logit_bias=True, token_prompts=True)
    context_length = int(settings.ctx)
    if context_length < 2:
        raise ValueError(f"the context must hold at least 2 tokens, got {context_length}")
    n_ctx_train = int(getattr(model, "n_ctx_train", 0) or 0)
    if n_ctx_train and context_length > n_ctx_train:
        log.warning(
            "context_exceeds_training",
            ctx=context_length,
            n_ctx_train=n_ctx_train,
            model=model_id,
        )

    tokenizer = Tokenizer.from_gguf(gguf)
    tokenizer.longest_token  # noqa: B018 - the length bound of prompts, found now
    fleet: FleetRouter | None = None
    chosen = settings.prefixes.fleet
    if chosen is not None:
        if cartridge or settings.disk.directory:
            raise ValueError("a fleet is served without --cartridge and --kv-cache-dir")
        rag = settings.prefixes.retrieval
        fleet = FleetRouter(
            chosen,
            model,
            tokenizer,
            what=model_id,
            docs=rag.docs,
            chunks=rag.chunks,
            adaptive=rag.adaptive,
            margin=rag.margin,
        )
        model = fleet.wrap(model)
        log.info(
            "fleet",
            path=str(chosen.path),
            documents=len(chosen.docs),
            p=chosen.p,
            rag_docs=fleet.k,
            prefix_rows=fleet.rows,
            adaptive=fleet.adaptive,
            model=model_id,
        )
    template = ChatTemplate.from_gguf(gguf, tokenizer, fallback=conventions.fallback_template)
    vocab_size = min(int(model.n_vocab), tokenizer.vocab_size)
    stop_ids = set(tokenizer.eog_ids)
    for text in conventions.extra_stop_tokens:
        tid = tokenizer.token_id(text)
        if tid is None:
            log.warning("unknown_stop_token", token=text, model=model_id)
        else:
            stop_ids.add(tid)
    shown = (tokenizer.token_id(text) for text in conventions.shown_tokens)
    shown_ids = frozenset(t for t in shown if t is not None)

    batch_size = max(1, int(settings.batch))
    per_pos = getattr(model, "kv_bytes_per_pos", None)
    whole = getattr(model, "kv_bytes", None)
    # what the slots take once every position is written (pages commit lazily)
    full = (
        whole(context_length)
        if callable(whole)
        else (None if per_pos is None else per_pos * context_length)
    )
    if settings.kv_slots == AUTO_SLOTS:
        avail = settings.available_memory or memory.available()
        n_slots = memory.auto_kv_slots(full, avail, batch_size)
    else:
        n_slots = max(1, int(settings.kv_slots), batch_size)
    n_slots, batch_size = _guard_memory(settings, per_pos, full, n_slots, batch_size, model_id)
    log.info(
        "kv_cache",
        model=model_id,
        kv_type=getattr(model, "kv_type", None),
        bytes_per_position=per_pos,
        ctx=context_length,
        slots=n_slots,
        full_mib=None if full is None else round(full * n_slots / 2**20, 1),
    )
    # what the family's caches can do (a small one asked)
    probe = model.new_cache(16)
    cache_kind: CacheKind = probe.kind
    close_quietly(probe)
    new_cache = model.new_cache
    slots: SlotPool[KVCache] = SlotPool(
        n_slots,
        lambda: new_cache(context_length),
        model.copy_rows,
        disk=_disk_tier(gguf, settings, model, cache_kind, prefix, model_id),
    )
    drafts = draft_source(settings, context_length, tokenizer, model_id) if speculate else None
    return ChatSetup(
        model_id=model_id,
        model=model,
        conventions=conventions,
        capabilities=capabilities,
        context_length=context_length,
        tokenizer=tokenizer,
        template=template,
        prefix=prefix,
        fleet=fleet,
        vocab_size=vocab_size,
        stop_ids=frozenset(stop_ids),
        shown_ids=shown_ids,
        batch_size=batch_size,
        kv_slots=n_slots,
        kv_bytes=None if full is None else int(full) * n_slots,
        cache_kind=cache_kind,
        slots=slots,
        drafts=drafts,
    )


def _disk_tier(
    gguf: GGUFFile,
    settings: ServerSettings,
    model: ForwardModel,
    kind: CacheKind,
    prefix: PrefixRows | None,
    model_id: str,
) -> DiskTier | None:
    """The KV disk tier under ``kv_cache_dir``, for this model and cache layout."""
    directory = settings.disk.directory
    if not directory:
        return None
    identity = {
        "model": model_fingerprint(gguf),
        "cache_kind": kind.name,
        "geometry": [list(layer) for layer in getattr(model, "cache_layers", None) or []],
        "kv_type": getattr(model, "kv_type", None),
        # the prefix under every file's rows (none without --cartridge)
        "prefix": None if prefix is None else prefix.record(),
    }
    if not kind.snapshot:
        log.warning("kv_disk_unsupported", kind=kind.name, model=model_id)
        return None
    return DiskTier(
        directory,
        identity,
        max_files=settings.disk.max_files,
        max_bytes=int(settings.disk.max_gb * 2**30),
    )


def _guard_memory(
    settings: ServerSettings,
    per_pos: int | None,
    per_slot: int | None,
    n_slots: int,
    batch_size: int,
    model_id: str,
) -> tuple[int, int]:
    """The RAM guard (``memory.plan_kv_slots``): the slots and batch to keep, with the
    arithmetic logged. Fewer slots than ``--batch`` lower the batch too (a slot per
    generation)."""
    if per_slot is None:
        return n_slots, batch_size
    avail = settings.available_memory or memory.available()
    plan = memory.plan_kv_slots(int(per_slot), n_slots, avail, force=settings.kv_slots_force)
    fields = dict(
        bytes_per_position=per_pos,
        bytes_per_slot=int(per_slot),
        slots=n_slots,
        total_bytes=int(per_slot) * n_slots,
        available_bytes=avail,
        model=model_id,
    )
    if plan.verdict in ("fits", "unknown"):
        log.info("kv_memory", **fields, verdict=plan.verdict)
    elif plan.verdict == "clamped":
        log.warning(
            "kv_memory",
            **fields,
            verdict="clamped",
            kept_slots=plan.slots,
            detail="the slots would not fit in memory: kept what fits in half of it "
            "(--kv-slots-force keeps them all)",
        )
    else:
        log.warning(
            "kv_memory",
            **fields,
            verdict=plan.verdict,
            detail="the slots take more than half of the available memory",
        )
    return plan.slots, min(batch_size, plan.slots)


# general.sampling.* keys (as llama.cpp's converter writes a model's generation_config)
# and the SamplingDefaults field each sets.
_FILE_SAMPLING = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repeat_penalty",
}


def file_sampling(gguf: GGUFFile, conventions: FamilyConventions) -> FamilyConventions:
    """``conventions`` with the sampling a file recommends (``general.sampling.*``) in place
    of the family's, thinking or not; values out of range are ignored."""
    found: dict[str, Any] = {}  # SamplingDefaults fields, each its type
    for key, name in _FILE_SAMPLING.items():
        value = gguf.metadata.get(f"general.sampling.{key}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            continue
        if (
            (name == "top_k" and (value < 0 or value != int(value)))
            or (name in ("top_p", "min_p") and not 0.0 <= value <= 1.0)
            or (name in ("temperature", "repeat_penalty") and value < 0.0)
        ):
            continue
        found[name] = int(value) if name == "top_k" else float(value)
    if not found:
        return conventions
    log.info("file_sampling", **found)
    thinking = conventions.thinking_sampling
    return replace(
        conventions,
        sampling=replace(conventions.sampling, **found),
        thinking_sampling=None if thinking is None else replace(thinking, **found),
    )


def close_quietly(obj: object) -> None:
    """``obj.close()`` when it has one."""
    close = getattr(obj, "close", None)
    if callable(close):
        close()
