"""Training a cartridge by self-study ("Cartridges", arXiv 2506.06266), with torch.

The cartridge is a KV prefix of ``p`` rows per layer: keys after the k-norm and after RoPE at
positions ``0..p-1``, values as the cache holds them. It starts as the model's own prefill of
the first ``p`` tokens of the corpus (rendered as a system message), row 0 (the attention
sink) stays frozen, and rows ``1..p-1`` are trained by context distillation:

1. Self-study. A random span of the corpus is put in the system message; the model writes a
   message about it (bot A, sampled, from one of a few seed prompts that give the *form* of
   the message, never its content) and answers that message with the span in context (bot B,
   greedy). Generation runs on lmserve's own engine in-process (the native kernels are many
   times faster than a torch decode on a CPU); the teacher's top-k next-token distribution
   over the answer comes from one teacher-forced torch pass over the same weights the
   student runs on.
2. Distillation. The student is the same model *without* the span, behind the cartridge, on
   the user message alone (the prompt a server would see); the loss is the teacher's top-k
   cross-entropy ``-sum p_teacher log q_student`` over the answer tokens (top 20 entries,
   truncated at 0.99 of the mass, not renormalised), Adam on the rows.

Gradients run through a torch copy of the model: transformers' GGUF loader dequantises the
file's weights (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``) and the
prefix goes in as ``past_key_values``, so the question's positions start at ``p``. The
loader un-permutes llama's q/k weights for transformers' half-split rotation; the cartridge
file holds keys the way lmserve's cache holds them (adjacent-pair rotation over the file's
permuted weights), so llama keys are re-permuted on the way out and back (:func:`key_order`).

The parts: the torch copy (:mod:`.torch_lm`), self-study (:mod:`.study`), distillation
(:mod:`.distill`) and question-answer accuracy (:mod:`.evaluate`); this module runs the build
and the command, and keeps their names importable from here.

Torch is an optional extra (``pip install lmserve-core[train]``); nothing at serving time
imports these modules.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .distill import (
    TOP_K,
    TOP_MASS,
    Conversation,
    Trainer,
    batch_for,
    distill_loss,
    teacher_targets,
)
from .evaluate import QA, accuracy, answers, read_questions
from .file import Cartridge, write_cartridge
from .study import (
    ASK_TRIES,
    CONTEXT_PROMPT,
    DIRECT_PROMPTS,
    SEED_PROMPTS,
    Model,
    TrainConfig,
    prefill_cartridge,
    prefill_ids,
    self_study,
)
from .torch_lm import PERMUTED_ARCHITECTURES, Prefix, TorchLM, key_order

__all__ = [
    "ASK_TRIES",
    "CONTEXT_PROMPT",
    "DIRECT_PROMPTS",
    "PERMUTED_ARCHITECTURES",
    "QA",
    "SEED_PROMPTS",
    "TOP_K",
    "TOP_MASS",
    "BuildResult",
    "Conversation",
    "Model",
    "Prefix",
    "TorchLM",
    "TrainConfig",
    "Trainer",
    "accuracy",
    "add_train_arguments",
    "answers",
    "batch_for",
    "build_command",
    "build_trained",
    "check_extra",
    "config_from",
    "distill_loss",
    "key_order",
    "load_model",
    "prefill_cartridge",
    "prefill_ids",
    "read_questions",
    "report_accuracy",
    "self_study",
    "teacher_targets",
]

# --------------------------------------------------------------------------- the build


@dataclass
class BuildResult:
    path: Path
    p: int
    steps: int
    conversations: int
    generate_s: float
    train_s: float
    held_out_init: float
    held_out_trained: float
    losses: list[float] = field(default_factory=list)


def _read_pool(path: Path) -> list[Conversation]:
    """The self-study set written so far; a last line cut short by an interrupted run is
    dropped (and the file rewritten without it)."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    pool = []
    for n, line in enumerate(lines):
        try:
            pool.append(Conversation.from_json(line))
        except (json.JSONDecodeError, TypeError):
            if n != len(lines) - 1:
                raise ValueError(f"{path}: line {n + 1} is not a self-study conversation") from None
            path.write_text("".join(c.to_json() + "\n" for c in pool))
    return pool


def build_trained(
    model: Model,
    corpus: str,
    out: str | os.PathLike[str],
    cfg: TrainConfig,
    *,
    work: str | os.PathLike[str] | None = None,
    resume: bool = False,
    say: Callable[[str], None] = print,
) -> BuildResult:
    """Self-study over ``corpus``, train, write the cartridge to ``out``. ``work`` (default
    ``OUT.work``) keeps the self-study set and the checkpoints; ``resume`` continues from
    them."""
    from lmserve_core import progress

    out = Path(out)
    work_dir = Path(work) if work is not None else out.with_name(out.name + ".work")
    work_dir.mkdir(parents=True, exist_ok=True)
    pool_path, state_path = work_dir / "selfstudy.jsonl", work_dir / "state.pt"
    config_path = work_dir / "config.json"
    if not resume and (pool_path.exists() or state_path.exists()):
        raise FileExistsError(f"{work_dir} holds an earlier run: --resume continues it")
    if resume and config_path.is_file():
        saved = json.loads(config_path.read_text())
        if saved.get("p") != cfg.p or saved.get("seed") != cfg.seed:
            raise ValueError(
                f"{work_dir} was started with p={saved.get('p')} seed={saved.get('seed')}"
            )
    config_path.write_text(json.dumps(asdict(cfg), indent=1))

    corpus_ids = model.encode(corpus)
    if not corpus_ids:
        raise ValueError("the corpus is empty")
    init = prefill_cartridge(model, corpus, cfg.p)
    p = init.p
    if p < cfg.p:
        say(f"the document has {p} tokens: p = {p}")
    k, v = model.lm.from_cartridge(init)
    init_prefix = (k.clone(), v.clone())
    prefix = Prefix(k, v)
    trainer = Trainer(model.lm, prefix, cfg.lr)

    # 1. self-study, appended conversation by conversation (resumable)
    pool = _read_pool(pool_path) if resume else []
    total = cfg.n_conversations()
    report = progress.tracker("cartridge_selfstudy", "self-study", unit="conversations")
    t0 = time.monotonic()
    with open(pool_path, "a") as fh:
        for i in range(len(pool), total):
            conv = self_study(model, corpus_ids, cfg, i)
            fh.write(conv.to_json() + "\n")
            fh.flush()
            pool.append(conv)
            report(i + 1, total)
    generate_s = time.monotonic() - t0
    held, train_pool = pool[: cfg.holdout], pool[cfg.holdout :]
    if not train_pool:
        raise ValueError("no self-study conversations left to train on after the held-out ones")

    # 2. distillation (resumable)
    if resume and state_path.is_file():
        trainer.load(state_path)
        say(f"resumed at step {trainer.step_no} of {cfg.steps}")
    held_init = trainer.held_out(held, init_prefix)
    report = progress.tracker("cartridge_train", "training", unit="steps")
    t0 = time.monotonic()
    while trainer.step_no < cfg.steps:
        trainer.step(batch_for(trainer.step_no, train_pool, cfg.accum, cfg.seed))
        report(trainer.step_no, cfg.steps)
        if trainer.step_no % cfg.save_every == 0 or trainer.step_no == cfg.steps:
            trainer.save(state_path)
    train_s = time.monotonic() - t0
    held_trained = trainer.held_out(held)

    cart = model.lm.to_cartridge(*prefix.full(), model.metadata(p, "trained"))
    cart.draft_reference = np.asarray(corpus_ids, np.int64)  # the whole corpus, for drafts
    cart.metadata.update(steps=str(cfg.steps), lr=str(cfg.lr), conversations=str(len(train_pool)))
    write_cartridge(out, cart)
    return BuildResult(
        out,
        p,
        trainer.step_no,
        len(train_pool),
        generate_s,
        train_s,
        held_init,
        held_trained,
        trainer.losses,
    )


# --------------------------------------------------------------------------- command line


def add_train_arguments(parser: Any) -> None:
    """The options of ``lmserve cartridge build --train`` (and of ``fleet``)."""
    d = TrainConfig()
    g = parser.add_argument_group("training (--train; needs pip install 'lmserve-core[train]')")
    g.add_argument(
        "--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})"
    )
    g.add_argument("--lr", type=float, default=d.lr, help=f"Adam's learning rate (default {d.lr})")
    g.add_argument(
        "--accum",
        type=int,
        default=d.accum,
        help=f"self-study conversations per step (default {d.accum})",
    )
    g.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="self-study conversations to generate (default: steps x accum / 2)",
    )
    g.add_argument(
        "--holdout",
        type=int,
        default=d.holdout,
        help=f"of those, kept out of training for the held-out loss (default {d.holdout})",
    )
    g.add_argument(
        "--chunk-min",
        type=int,
        default=d.chunk_min,
        help=f"shortest corpus chunk in tokens (default {d.chunk_min})",
    )
    g.add_argument(
        "--chunk-max",
        type=int,
        default=d.chunk_max,
        help=f"longest corpus chunk in tokens (default {d.chunk_max})",
    )
    g.add_argument(
        "--max-answer",
        type=int,
        default=d.max_a,
        help=f"tokens of a self-study answer at most (default {d.max_a})",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="random seed (default 0)")
    g.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help=f"steps between checkpoints (default {d.save_every})",
    )
    g.add_argument(
        "--work", help="directory of the self-study set and checkpoints (default: OUT.work)"
    )
    g.add_argument("--resume", action="store_true", help="continue the run in the work directory")
    g.add_argument(
        "--eval",
        metavar="QUESTIONS",
        help="held-out questions (JSON: [{question, answer, doc?}]) whose accuracy "
        "is printed without and with the cartridge",
    )


def config_from(args: Any) -> TrainConfig:
    return TrainConfig(
        p=args.p,
        steps=args.steps,
        lr=args.lr,
        accum=args.accum,
        conversations=args.conversations,
        holdout=args.holdout,
        chunk_min=args.chunk_min,
        chunk_max=args.chunk_max,
        max_a=args.max_answer,
        seed=args.seed,
        save_every=args.save_every,
        threads=args.threads,
    )


def check_extra() -> None:
    """A clear error when the train extra is not installed."""
    from .file import CartridgeError

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise CartridgeError(
            f"training needs the train extra (pip install 'lmserve-core[train]'): {exc}"
        ) from None


def load_model(args: Any) -> Model:
    """The model of ``lmserve cartridge``'s ``--model`` (the plugin default when absent)."""
    from ..launch import load_backend

    check_extra()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    return Model.from_backend(load_backend(args, 4096))


def report_accuracy(
    model: Model,
    questions: Sequence[QA],
    cartridges: Sequence[tuple[str, Cartridge | None]],
    say: Callable[[str], None] = print,
) -> dict[str, float]:
    """Held-out accuracy of each (label, cartridge), printed."""
    out = {}
    for label, cart in cartridges:
        acc = accuracy(model, questions, cart)
        right = round(acc * len(questions))
        say(f"held-out accuracy {label}: {right}/{len(questions)} ({100 * acc:.0f}%)")
        out[label] = acc
    return out


def build_command(args: Any) -> int:
    """``lmserve cartridge build --train CORPUS OUT``."""
    from .file import read_cartridge

    cfg = config_from(args)
    if cfg.p < 2 or cfg.steps < 0 or cfg.accum < 1 or cfg.lr <= 0:
        raise ValueError(
            "--p must be at least 2, --steps at least 0, --accum at least 1, --lr positive"
        )
    corpus_path = Path(args.corpus)
    text = corpus_path.read_text(encoding="utf-8")
    questions = read_questions(args.eval, corpus_path.stem) if args.eval else []
    model = load_model(args)
    try:
        started = time.perf_counter()
        r = build_trained(model, text, args.out, cfg, work=args.work, resume=args.resume)
        print(
            f"wrote {r.path}: p = {r.p}, {r.steps} steps over {r.conversations} self-study "
            f"conversations; held-out distillation loss {r.held_out_init:.4f} (prefill) -> "
            f"{r.held_out_trained:.4f} (trained); self-study {r.generate_s:.0f} s, training "
            f"{r.train_s:.0f} s, {time.perf_counter() - started:.0f} s in all"
        )
        if questions:
            report_accuracy(
                model,
                questions,
                [
                    ("without the cartridge", None),
                    ("behind the prefill cartridge", prefill_cartridge(model, text, cfg.p)),
                    ("behind the trained cartridge", read_cartridge(r.path)),
                ],
            )
    finally:
        model.close()
    return 0
