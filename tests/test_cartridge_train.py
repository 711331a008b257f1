"""The cartridge trainer's mechanics on a tiny random llama (transformers, torch): the
distillation loss falls, the sink row stays frozen, a saved cartridge reads back to the same
rows (llama keys re-permuted to the file's order and back), an interrupted run resumes to
the rows of an uninterrupted one, and batched greedy decoding behind a prefix matches one
prompt at a time. The fleet index routes by cosine after centring. Real-model training and
routing are in test_real_cartridge_train.py."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lmserve_core.cartridge import read_cartridge, write_cartridge  # noqa: E402
from lmserve_core.cartridge import train as T  # noqa: E402
from lmserve_core.cartridge.fleet import (  # noqa: E402
    EMBED_SUFFIX,
    Fleet,
    FleetError,
    FleetIndex,
    chunks,
    embed_tokens,
    query_text,
)

VOCAB = 48


@pytest.fixture(scope="module")
def lm() -> Iterator[T.TorchLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=True,
        initializer_range=0.2,  # sharp enough attention that the context matters
    )
    hf = transformers.LlamaForCausalLM(cfg).float()
    yield T.TorchLM(hf, permuted=True)
    torch.set_num_threads(threads)


def conversations(lm: T.TorchLM, n: int, context: list[int]) -> list[T.Conversation]:
    """Teacher: ``context`` in front of a question; student: the question alone."""
    rng = random.Random(1)
    out = []
    for _ in range(n):
        question = [rng.randrange(3, VOCAB) for _ in range(6)]
        answer = [rng.randrange(3, VOCAB) for _ in range(8)]
        teacher = context + question + answer
        with torch.no_grad():
            logits = lm.logits(teacher)
        ids, lps = T.teacher_targets(logits, len(context) + len(question), len(answer), k=8)
        out.append(T.Conversation(question + answer, len(question), ids, lps))
    return out


def test_key_order_pairs_halves() -> None:
    order = T.key_order(8)
    assert order.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert sorted(order.tolist()) == list(range(8))


def test_teacher_targets_truncate_at_mass() -> None:
    logits = torch.full((3, 10), -20.0)
    logits[:, 2] = 10.0  # one token holds almost all the mass
    ids, lps = T.teacher_targets(logits, 1, 2, k=5)
    assert ids == [[2], [2]]
    assert lps[0][0] == pytest.approx(0.0, abs=1e-6)


def test_training_lowers_the_loss_and_keeps_the_sink(lm: T.TorchLM) -> None:
    context = list(range(3, 19))
    convs = conversations(lm, 6, context)
    k, v = lm.prefill(list(range(20, 36)))  # rows of other tokens: the teacher's context is not in them
    prefix = T.Prefix(k, v)
    sink = prefix.sink_k.clone()
    trainer = T.Trainer(lm, prefix, lr=5e-2)
    # the loss is a cross-entropy: the teacher's own entropy is its floor, reached by the
    # rows of the teacher's context itself (same tokens at the same positions)
    floor = trainer.held_out(convs, lm.prefill(context))
    before = trainer.held_out(convs)
    assert before > floor + 0.3
    for step in range(30):
        trainer.step(T.batch_for(step, convs, 3, seed=0))
    after = trainer.held_out(convs)
    assert after - floor < 0.5 * (before - floor), (floor, before, after)
    assert trainer.losses[-1] < trainer.losses[0]
    assert torch.equal(prefix.sink_k, sink)


def test_cartridge_file_round_trip(lm: T.TorchLM, tmp_path) -> None:
    k, v = lm.prefill(list(range(3, 13)))
    cart = lm.to_cartridge(k, v, {"architecture": "llama", "init": "prefill"})
    assert cart.p == 10 and cart.k[0].shape == (10, 2, 8)
    # the file holds keys in adjacent-pair order: pair (2i, 2i+1) is transformers' (i, i+d/2)
    hf = k[0].transpose(0, 1).numpy()  # [p, kv, d]
    assert np.array_equal(cart.k[0][..., 0], hf[..., 0])
    assert np.array_equal(cart.k[0][..., 1], hf[..., 4])
    write_cartridge(tmp_path / "c.safetensors", cart)
    back = read_cartridge(tmp_path / "c.safetensors")
    assert back.metadata["init"] == "prefill" and back.frozen_prefix == 1
    k2, v2 = lm.from_cartridge(back)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_resume_continues_exactly(lm: T.TorchLM, tmp_path) -> None:
    convs = conversations(lm, 4, list(range(3, 15)))
    k, v = lm.prefill(list(range(20, 32)))

    whole = T.Trainer(lm, T.Prefix(k, v), lr=1e-2)
    for step in range(6):
        whole.step(T.batch_for(step, convs, 2, seed=3))

    first = T.Trainer(lm, T.Prefix(k, v), lr=1e-2)
    for step in range(3):
        first.step(T.batch_for(step, convs, 2, seed=3))
    first.save(tmp_path / "state.pt")
    second = T.Trainer(lm, T.Prefix(k, v), lr=1e-2)
    second.load(tmp_path / "state.pt")
    assert second.step_no == 3
    while second.step_no < 6:
        second.step(T.batch_for(second.step_no, convs, 2, seed=3))
    assert torch.allclose(second.prefix.k, whole.prefix.k, atol=1e-6)
    assert second.losses == pytest.approx(whole.losses, abs=1e-6)

    other = T.Trainer(lm, T.Prefix(*lm.prefill(list(range(20, 25)))), lr=1e-2)
    with pytest.raises(ValueError, match="rows"):
        other.load(tmp_path / "state.pt")


def test_batched_greedy_matches_one_at_a_time(lm: T.TorchLM) -> None:
    prefix = lm.prefill(list(range(3, 11)))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
    together = lm.generate(prompts, prefix, 6, set())
    alone = [lm.generate([q], prefix, 6, set())[0] for q in prompts]
    assert together == alone
    # and behind the prefix differs from without it (the rows are read)
    assert lm.generate(prompts, None, 6, set()) != together


def test_conversation_json_round_trip() -> None:
    c = T.Conversation([1, 2, 3], 2, [[3, 4]], [[-0.1, -2.5]], "q?", "a", 1)
    assert T.Conversation.from_json(c.to_json()) == c


def test_read_questions_filters_by_document(tmp_path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps([
        {"doc": "a", "question": "x?", "answer": "1"},
        {"doc": "b", "question": "y?", "answer": "2"},
        {"question": "z?", "answer": "3"},
    ]))
    assert [q.answer for q in T.read_questions(path, "a")] == ["1", "3"]
    assert len(T.read_questions(path)) == 3


# --------------------------------------------------------------------------- fleet index


def test_index_centres_and_routes(tmp_path) -> None:
    rng = np.random.default_rng(0)
    shared = rng.normal(size=16) * 10  # the dominant direction every row shares
    topics = rng.normal(size=(3, 16))
    vectors, docs = [], []
    for d in range(3):
        for _ in range(2):
            vectors.append(shared + topics[d] + 0.1 * rng.normal(size=16))
            docs.append(d)
    index = FleetIndex.build(vectors, docs)
    assert np.allclose(np.linalg.norm(index.embeddings, axis=1), 1, atol=1e-5)
    for d in range(3):
        query = shared + topics[d] + 0.1 * rng.normal(size=16)
        hits = index.top_docs(query, k=2)
        assert hits[0][0] == d and hits[1][0] != d
        assert index.doc_scores(query).argmax() == d
    index.save(tmp_path / "index.safetensors")
    back = FleetIndex.load(tmp_path / "index.safetensors")
    assert np.array_equal(back.embeddings, index.embeddings)
    assert back.chunk_doc.dtype == np.int64 and back.chunk_doc.tolist() == docs
    with pytest.raises(FleetError, match="dimensions"):
        index.top_docs(np.ones(3))


def test_fleet_open_checks_its_files(tmp_path) -> None:
    with pytest.raises(FleetError, match="fleet.json"):
        Fleet.open(tmp_path)
    (tmp_path / "fleet.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(FleetError, match="format"):
        Fleet.open(tmp_path)
    (tmp_path / "fleet.json").write_text(json.dumps({
        "format": "lmserve-fleet/1", "p": 4, "embed_suffix": EMBED_SUFFIX,
        "docs": [{"name": "a.md", "cart_file": "doc-000.safetensors", "tokens": 9}],
    }))
    with pytest.raises(FleetError, match="missing"):
        Fleet.open(tmp_path)


def test_chunks_and_query_text() -> None:
    assert [len(c) for c in chunks(list(range(600)), 256)] == [256, 256, 88]
    assert [len(c) for c in chunks(list(range(530)), 256)] == [256, 256]  # a short tail goes
    assert [len(c) for c in chunks(list(range(10)), 256)] == [10]  # unless it is all there is
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "second"}]},
    ]
    assert query_text(messages) == "first\nsecond"


class _Vocab:
    add_bos, bos_id = True, 1

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        assert not add_special
        return [len(w) for w in text.split()]


def test_embed_tokens_adds_bos_and_suffix() -> None:
    ids = embed_tokens(_Vocab(), [7, 8])
    assert ids[:3] == [1, 7, 8] and ids[3:] == _Vocab().encode(EMBED_SUFFIX)


def test_cli_takes_the_training_and_fleet_options() -> None:
    from lmserve_core.cartridge.cli import build_parser

    args = build_parser().parse_args(
        ["build", "doc.md", "out.safetensors", "--p", "64", "--train", "--steps", "7",
         "--lr", "0.01", "--resume", "--eval", "q.json"]
    )
    cfg = T.config_from(args)
    assert args.train and args.resume and args.eval == "q.json"
    assert (cfg.p, cfg.steps, cfg.lr) == (64, 7, 0.01)
    args = build_parser().parse_args(["fleet", "docs", "out", "--init", "prefill", "--p", "32"])
    assert (args.command, args.init, args.p, args.embed_chunk) == ("fleet", "prefill", 32, 256)


def test_a_cut_last_conversation_is_dropped(tmp_path) -> None:
    c = T.Conversation([1, 2, 3], 2, [[3]], [[-0.1]])
    path = tmp_path / "selfstudy.jsonl"
    path.write_text(c.to_json() + "\n" + c.to_json()[:10])
    assert T._read_pool(path) == [c]
    assert path.read_text() == c.to_json() + "\n"
    path.write_text("{not json\n" + c.to_json() + "\n")
    with pytest.raises(ValueError, match="line 1"):
        T._read_pool(path)
