"""Building a fleet (``lmserve cartridge fleet``): a cartridge per document of a corpus,
by self-study (:mod:`.train`, the train extra) or prefill, then the index that routes
conversations to them. What the server reads of a fleet is in :mod:`.fleet`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .fleet import (
    DOC_SUFFIXES,
    EMBED_CHUNK,
    EMBED_SUFFIX,
    FLEET_FORMAT,
    INDEX,
    MANIFEST,
    Fleet,
    FleetDoc,
    FleetError,
    FleetIndex,
    chunks,
    doc_file,
    embed_tokens,
)


def corpus_documents(corpus_dir: str | os.PathLike[str]) -> list[Path]:
    """The documents of a fleet's corpus: the directory's ``.md`` and ``.txt`` files, sorted
    by name."""
    d = Path(corpus_dir)
    if not d.is_dir():
        raise FleetError(f"{d}: not a directory")
    docs = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in DOC_SUFFIXES)
    if not docs:
        raise FleetError(f"{d}: no .md or .txt documents")
    return docs


def build_fleet(
    model: Any,
    corpus_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    cfg: Any,
    *,
    init: str = "train",
    resume: bool = False,
    embed_chunk: int = EMBED_CHUNK,
    say: Callable[[str], None] = print,
) -> Fleet:
    """Build a fleet of ``corpus_dir``'s documents into ``out``: a cartridge per document
    (``init`` "train": self-study with ``cfg``, a :class:`~.train.TrainConfig`; "prefill":
    the document's first ``cfg.p`` tokens), then the index. ``resume`` keeps the cartridges
    already written and continues the one in progress."""
    from lmserve_core import progress

    from . import train
    from .file import write_cartridge

    if init not in ("train", "prefill"):
        raise FleetError(f"init {init!r}: train or prefill")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = corpus_documents(corpus_dir)
    docs: list[FleetDoc] = []
    texts = [p.read_text() for p in paths]
    for i, (path, text) in enumerate(zip(paths, texts, strict=True)):
        target = out / doc_file(i)
        n_tokens = len(model.encode(text))
        docs.append(FleetDoc(path.name, target.name, n_tokens, "trained" if init == "train" else "prefill"))
        if resume and target.is_file():
            say(f"{path.name}: {target.name} is there")
            continue
        if init == "prefill":
            write_cartridge(target, train.prefill_cartridge(model, text, cfg.p))
        else:
            work = out / "work" / target.stem
            r = train.build_trained(model, text, target, cfg, work=work, resume=resume and work.exists(), say=say)
            say(
                f"{path.name}: {target.name}, {r.steps} steps over {r.conversations} conversations, "
                f"held-out loss {r.held_out_init:.4f} -> {r.held_out_trained:.4f} "
                f"(self-study {r.generate_s:.0f} s, training {r.train_s:.0f} s)"
            )

    vectors: list[np.ndarray] = []
    owners: list[int] = []
    all_chunks = [(i, c) for i, t in enumerate(texts) for c in chunks(model.encode(t), embed_chunk)]
    report = progress.tracker("fleet_index", "embedding", unit="chunks")
    for n, (i, c) in enumerate(all_chunks):
        vectors.append(model.lm.embed(embed_tokens(model.tokenizer, c)))
        owners.append(i)
        report(n + 1, len(all_chunks))
    index = FleetIndex.build(vectors, owners)
    index.save(out / INDEX)
    manifest = {
        "format": FLEET_FORMAT,
        "p": cfg.p,
        "frozen_prefix": 1,
        "embed_chunk": embed_chunk,
        "embed_suffix": EMBED_SUFFIX,
        "embed_dim": index.dim,
        "architecture": model.architecture,
        "model": model.path.name,
        "docs": [
            {"name": d.name, "cart_file": d.cart_file, "tokens": d.tokens, "init": d.init} for d in docs
        ],
    }
    tmp = out / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return Fleet.open(out)


def add_fleet_parser(sub: Any) -> None:
    """``lmserve cartridge fleet CORPUS_DIR OUT``."""
    from .train import add_train_arguments

    f = sub.add_parser(
        "fleet",
        help="a cartridge per document and a retrieval index",
        description="Write a fleet: one cartridge per .md/.txt document of CORPUS_DIR "
        "(trained by self-study, or with --init prefill the documents' first p tokens) and the "
        "index that picks them per conversation (`lmserve --fleet OUT`).",
    )
    f.add_argument("corpus_dir", help="a directory of UTF-8 .md / .txt documents")
    f.add_argument("out", help="the fleet directory to write")
    f.add_argument("--p", type=int, default=128, help="rows of each cartridge (default 128)")
    f.add_argument("--init", choices=["train", "prefill"], default="train",
                   help="train each cartridge by self-study (default) or keep the prefill rows")
    f.add_argument("--embed-chunk", type=int, default=EMBED_CHUNK,
                   help=f"tokens per index chunk (default {EMBED_CHUNK})")
    f.add_argument("--model", help="the GGUF model (default: the model an installed plugin ships)")
    f.add_argument("--backend", help="backend name (default: chosen by the GGUF's architecture)")
    f.add_argument(
        "--kv-type", choices=["f16", "f32"], default="f16",
        help="the KV cache prefill rows are computed in (the servers' --kv-type; default f16)",
    )
    f.add_argument("--threads", type=int, default=0, help="compute threads (default: all cores)")
    f.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    add_train_arguments(f)


def fleet_command(args: Any) -> int:
    """Build the fleet; with ``--eval``, route each question and print the routing accuracy."""
    from . import train

    cfg = train.config_from(args)
    if cfg.p < 2 or args.embed_chunk < 1:
        raise FleetError("--p must be at least 2 and --embed-chunk at least 1")
    model = train.load_model(args)
    try:
        started = time.perf_counter()
        fleet = build_fleet(model, args.corpus_dir, args.out, cfg, init=args.init,
                            resume=args.resume, embed_chunk=args.embed_chunk)
        print(
            f"wrote {fleet.path}: {len(fleet.docs)} cartridges, index of "
            f"{fleet.index.embeddings.shape[0]} chunks x {fleet.index.dim}, "
            f"{time.perf_counter() - started:.0f} s"
        )
        if args.eval:
            rows = json.loads(Path(args.eval).read_text())
            names = [Path(d.name).stem for d in fleet.docs]
            right = 0
            for r in rows:
                got = fleet.select(model.lm.embed, model.tokenizer, r["question"], k=1)
                right += bool(got) and names[got[0][0]] == r.get("doc")
            print(f"routing accuracy: {right}/{len(rows)}")
    finally:
        model.close()
    return 0
