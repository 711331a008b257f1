"""Tokenization from GGUF metadata, matching llama.cpp's ids.

The merge work runs in the ``tokenizers`` library (Rust). Around it this module reproduces
what llama.cpp does before and after the model: special tokens are split out of the text
first (longest first; user-defined tokens always, control tokens only when asked), BPE
vocabularies get the pre-tokenizer that ``tokenizer.ggml.pre`` names (every name llama.cpp
knows, with the regexes and settings llama.cpp gives it: docs/tokenizers.md), and
SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) get a BPE whose merges are
ranked by the score of the merged piece, which is how llama.cpp's SPM tokenizer merges.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from lmserve_core.gguf_file import GGUFFile

__all__ = [
    "PRE_TOKENIZER_NAMES",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenType",
    "TooManyTokens",
]

log = structlog.get_logger("lmserve.tokenizer")


class TokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


class TooManyTokens(ValueError):
    """:meth:`Tokenizer.encode_within` stopped: the text has more tokens than allowed.
    ``at_least`` is a lower bound of its token count (more than ``most``)."""

    def __init__(self, at_least: int, most: int, *, exact: bool = False) -> None:
        super().__init__(f"at least {at_least} tokens, more than the {most} allowed")
        self.at_least = at_least
        self.most = most
        self.exact = exact  # at_least is the count itself (the whole text was encoded)


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# -- pre-tokenizers (llama.cpp's llama-vocab.cpp) ---------------------------------------------

# llm_tokenizer_bpe's regexes per LLAMA_VOCAB_PRE_TYPE_* (the lower-case names sharing them),
# verbatim: C++'s string escapes are Python's. llama.cpp splits the text with each in turn,
# keeping matches and the text between them; :func:`_split_steps` says how they run here.
_REGEXES_BY_TYPES: dict[str, tuple[str, ...]] = {
    "llama3 dbrx smaug chatglm4": (
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "jais2": (
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|"
            "\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}"
        ),
    ),
    "deepseek_llm": (
        "[\r\n]",
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-\ud7ff]+",
        "\\p{N}+",
    ),
    "deepseek3_llm hunyuan_dense joyai_llm hy_v4": (
        "\\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        (
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
            "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "spark2_5": (
        "\\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        (
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
            "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+"
        ),
        "\\p{N}",
    ),
    "youtu": (
        "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+",
        (
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|"
            "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|"
            "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
    ),
    "deepseek_coder": (
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[一-龥ࠀ-一가-\ud7ff]+",
        "\\p{N}",
    ),
    "falcon": (
        "[\\p{P}\\$\\+<=>\\^~\\|`]+",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        "[0-9][0-9][0-9]",
    ),
    "starcoder refact command_r smollm codeshell exaone minerva mellum2": (
        "\\p{N}",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    "gpt2 mpt olmo jais trillion granite_docling": (
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    "stablelm2 qwen2 hunyuan solar_open grok_2": (
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "qwen35": (
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|"
            "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
    ),
    "poro bloom gpt3_finnish": (" ?[^(\\s|.,!?…。，、।۔،)]+",),
    "viking": (
        " ?[^(\\s|.,!?…。，、।۔،)]+",
        "\\p{N}",
    ),
    "tekken": (
        (
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|"
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
    ),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ),
    "gpt4o minimax_m2": (
        (
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|"
            "'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|"
            "'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
    ),
    "granite_emb_multi inkling": (
        (
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|"
            "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|"
            "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
    ),
    "tiny_aya": (
        "\\d{1,3}(?=(?:\\d{3})*\\b)",
        (
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|"
            "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
            "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|"
            "'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
    ),
    "kimi_k2": ("\\p{Han}+",),
    "superbpe": (
        "\\p{N}+",
        "(?=(\\d{3})+(?!\\d))",
    ),
    "bailingmoe": (
        (
            "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"
        ),
    ),
    "seed_coder": (
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "ufakzeka": (
        (
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "afmoe": (
        "\\p{AFMoE_digits}",
        "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+",
        (
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
            "[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "laguna": (
        "[^\\n]+|[\\n]+",
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "exaone_moe": (
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}|"
            " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"
        ),
    ),
    "gemma4 sarvam_moe": ("[^\\n]+|[\\n]+",),
    "minicpm5": (
        "\\p{N}{1,3}",
        (
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
            "\\s+(?!\\S)|\\s+"
        ),
    ),
    "whitespace": ("\\S+",),
    # not llama.cpp's: nanochat's SPLIT_PATTERN (nanochat/tokenizer.py, GPT-4's with digits by
    # up to two), for the vocabularies lmserve-nanochat reads from nanochat's own files
    "nanochat": (
        (
            "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}{1,2}|"
            " ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"
        ),
    ),
    "default": (
        "[\\p{P}\\$\\+<=>\\^~\\|]+",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        "\\p{N}+",
        "[0-9][0-9][0-9]",
    ),
}
_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    kind: regexes for kinds, regexes in _REGEXES_BY_TYPES.items() for kind in kinds.split()
}
# Types whose words are merged as raw UTF-8 with <0xXX> byte tokens (llama.cpp's
# byte_encode = false), not as GPT-2's byte characters.
_RAW_UTF8 = frozenset(("gemma4", "sarvam_moe", "whitespace"))


@dataclass(frozen=True)
class _PreTokenizer:
    """What llama_vocab::impl::load sets for one ``tokenizer.ggml.pre`` name."""

    type: str  # a key of _PRE_REGEXES
    ignore_merges: bool = False  # a word that is a token is that token
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token
    clean_spaces: bool = True  # llama_detokenize's clean-up (``decode(clean_spaces=True)``)
    escape_whitespaces: bool = False  # spaces become U+2581 before splitting
    bos: bool = True  # False: no default BOS id (tokenizer.ggml.bos_token_id still counts)
    add_sep: bool = False  # llama.cpp's add_sep (its reranking prompts); recorded only


# tokenizer.ggml.pre -> pre-tokenizer, in the order of llama.cpp's chain of names.
_PRE_NAMES: dict[str, _PreTokenizer] = {}


def _names(kind: str, names: str, **flags: bool) -> None:
    for name in names.split():
        _PRE_NAMES[name] = _PreTokenizer(kind, **flags)


_LLAMA3_NAMES = "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano"
_GPT2_NAMES = (
    "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert"
)
_names("default", "default")
_names("minicpm5", "minicpm5", ignore_merges=True)
_names("llama3", _LLAMA3_NAMES, ignore_merges=True, add_bos=True)
_names("deepseek_llm", "deepseek-llm", clean_spaces=False)
_names("deepseek_coder", "deepseek-coder", clean_spaces=False)
_names("deepseek3_llm", "deepseek-v3", clean_spaces=False)
_names("spark2_5", "spark2_5", clean_spaces=False)
_names("youtu", "youtu", clean_spaces=False, ignore_merges=True)
_names("falcon", "falcon")
_names("mpt", "mpt")
_names("starcoder", "starcoder")
_names("gpt2", _GPT2_NAMES)
_names("jais2", "jais-2")
_names("gemma4", "gemma4 granite-embed-multi-311m", escape_whitespaces=True)
_names("sarvam_moe", "sarvam-moe", escape_whitespaces=True, clean_spaces=False)
_names("gpt2", "jina-v1-en jina-v2-code roberta-bpe", add_sep=True)
_names("whitespace", "whitespace")  # also sets the normalizer's lowercase default to false
_names("refact", "refact")
_names("command_r", "command-r", clean_spaces=False)
_names("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2", clean_spaces=False)
_names("qwen35", "qwen35", clean_spaces=False)
_names("stablelm2", "stablelm2")
_names("olmo", "olmo")
_names("dbrx", "dbrx")
_names("smaug", "smaug-bpe")
_names("poro", "poro-chat", clean_spaces=False)
_names("chatglm4", "chatglm-bpe", bos=False)
_names("chatglm4", "glm4 glm5", bos=False, ignore_merges=True)
_names("viking", "viking", clean_spaces=False)
_names("jais", "jais")
_names("tekken", "tekken", clean_spaces=False, ignore_merges=True, add_bos=True)
_names("smollm", "smollm", clean_spaces=False)
_names("codeshell", "codeshell")
_names("bloom", "bloom")
_names("gpt3_finnish", "gpt3-finnish")
_names("exaone", "exaone")
_names("gpt2", "exaone4")
_names("exaone_moe", "exaone-moe")
_names("chameleon", "chameleon", add_bos=True, clean_spaces=False)
_names("minerva", "minerva-7b")
_names("qwen2", "megrez")
_names("gpt4o", "gpt-4o llama4 kanana2 talkie", clean_spaces=False)
_names("granite_emb_multi", "granite-embed-multi-97m", clean_spaces=False, ignore_merges=True)
_names("tiny_aya", "tiny_aya cohere2moe", clean_spaces=False)
_names("superbpe", "superbpe", clean_spaces=False)
_names("trillion", "trillion", clean_spaces=False)
_names("granite_docling", "granite-docling", clean_spaces=False)
_names("bailingmoe", "bailingmoe bailingmoe2 llada-moe", clean_spaces=False)
_names("seed_coder", "seed-coder", clean_spaces=False)
_names("hunyuan", "hunyuan", clean_spaces=False)
_names("hunyuan_dense", "hunyuan-dense", clean_spaces=False)
_names("hy_v4", "hy_v4", clean_spaces=False)
_names("joyai_llm", "joyai-llm", clean_spaces=False)
_names("kimi_k2", "kimi-k2", clean_spaces=False)
_names("ufakzeka", "ufakzeka", clean_spaces=False)
_names("grok_2", "grok-2", clean_spaces=False)
_names("afmoe", "afmoe", clean_spaces=False)
_names("laguna", "laguna", clean_spaces=False)
_names("minimax_m2", "minimax-m2", clean_spaces=False)
_names("solar_open", "solar-open", clean_spaces=False)
_names("mellum2", "mellum2")
# llama.cpp gives "<mask>" lstrip (whitespace before it is dropped) when the name contains one
# of these.
_MASK_LSTRIP_PRES = ("jina-v2-de", "jina-v2-es", "jina-v2-code")
# Every tokenizer.ggml.pre name llama.cpp knows, in the order of its chain.
PRE_TOKENIZER_NAMES: tuple[str, ...] = tuple(_PRE_NAMES)
# lmserve's own names, for vocabularies that come without a GGUF file: tiktoken's encodings
# take a piece that is a token as that token (ignore merges) and clean no spaces.
_names("nanochat", "nanochat", ignore_merges=True, clean_spaces=False)
# Names of open llama.cpp work not yet in its chain: "inkling", Thinking Machines' Inkling (the
# PR "Add TML Inkling architecture": LLAMA_VOCAB_PRE_TYPE_INKLING, the regex of
# granite-embed-multi-97m, merges kept, no clean-up of spaces).
_names("inkling", "inkling", clean_spaces=False)

# What llama.cpp runs in C++ instead of some of those regexes, as regexes to the same effect:
# expression -> (regex, how tokenizers' Split keeps the matches).
_GPT2_EXPR = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_HAN = (  # unicode_cpt_is_han
    r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}"
    r"\x{2B740}-\x{2B81F}\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}"
    r"\x{2F800}-\x{2FA1F}"
)
# Kimi K2's handler: Han runs, then the other letters as one class (no upper/lower split,
# marks not included) with an optional contraction, digits by three, and the rest as llama3.
_KIMI_K2 = (
    f"[{_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}&&[^{_HAN}]]+"
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# AFMoE's digit handler (tiny_aya's digit regex runs it too): a run of digits in groups of
# three from the right, the first group glued to the text before it (pieces end after each
# group). Only the first group of a run looks ahead, so this is linear.
_DIGIT_GROUPS = "(?<!\\p{N})\\p{N}{1,3}(?=(?:\\p{N}{3})*(?!\\p{N}))|\\p{N}{3}"
# SuperBPE's "(?=(\d{3})+(?!\d))" (a split before every ASCII digit that begins a multiple of
# three digits running to a non-digit), without its quadratic lookahead: pieces end at those
# points, after the character before a run of 3k digits, a run's first 1-2 digits, or each
# group of three that more digits follow.
_SUPERBPE_DIGITS = (
    "[^0-9](?=(?:[0-9]{3})+(?![0-9]))|(?<![0-9])[0-9]{1,2}(?=(?:[0-9]{3})+(?![0-9]))"
    "|[0-9]{3}(?=[0-9])"
)
_CUSTOM: dict[str, tuple[str, str]] = {
    # the GPT-2 handler ends in "|\s+" (whitespace before a non-space)
    _GPT2_EXPR: (_GPT2_EXPR + "|\\s+", "isolated"),
    "\\p{Han}+": (_KIMI_K2, "isolated"),
    "\\p{AFMoE_digits}": (_DIGIT_GROUPS, "merged_with_previous"),
    "\\d{1,3}(?=(?:\\d{3})*\\b)": (_DIGIT_GROUPS, "merged_with_previous"),
    "(?=(\\d{3})+(?!\\d))": (_SUPERBPE_DIGITS, "merged_with_previous"),
}
# Code points Unicode 16 assigned: llama.cpp's tables (Unicode 15.1) give them no category, so
# no \p{..} of its regexes matches them (Oniguruma's tables are Unicode 16).
_UNICODE_16 = (
    r"\x{897}\x{1B4E}-\x{1B4F}\x{1B7F}\x{1C89}-\x{1C8A}\x{2427}-\x{2429}\x{31E4}-\x{31E5}"
    r"\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D40}-\x{10D65}"
    r"\x{10D69}-\x{10D85}\x{10D8E}-\x{10D8F}\x{10EC2}-\x{10EC4}\x{10EFC}\x{11380}-\x{11389}"
    r"\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}-\x{113C0}\x{113C2}\x{113C5}"
    r"\x{113C7}-\x{113CA}\x{113CC}-\x{113D5}\x{113D7}-\x{113D8}\x{113E1}-\x{113E2}"
    r"\x{116D0}-\x{116E3}\x{11BC0}-\x{11BE1}\x{11BF0}-\x{11BF9}\x{11F5A}\x{13460}-\x{143FA}"
    r"\x{16100}-\x{16139}\x{16D40}-\x{16D79}\x{18CFF}\x{1CC00}-\x{1CCF9}\x{1CD00}-\x{1CEB3}"
    r"\x{1E5D0}-\x{1E5FA}\x{1E5FF}\x{1F8B2}-\x{1F8BB}\x{1F8C0}-\x{1F8C1}\x{1FA89}\x{1FA8F}"
    r"\x{1FABE}\x{1FAC6}\x{1FADC}\x{1FADF}\x{1FAE9}\x{1FBCB}-\x{1FBEF}"
)
_CATEGORY = re.compile(r"\\p\{(L[ultmo]?|N|M|P|S)\}")
# The whitespace llama.cpp replaces by \v before matching a regex (all but ASCII's).
_WIDE_SPACES = r"\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}"


def _onig(expr: str) -> str:
    """A llama.cpp regex as Oniguruma (``tokenizers``) must read it to match what llama.cpp
    matches. llama.cpp matches a copy of the text in which non-ASCII whitespace is \\v, and
    if the regex has \\p{..} classes, every other character is reduced to its category.
    So: each \\p{..} leaves out the Unicode 16 code points (llama.cpp's tables are Unicode
    15.1); \\p{Lu}, \\p{Ll}, \\p{Lt}, \\p{Lm} and \\p{Lo} all mean \\p{L}; a class of
    characters does not take non-ASCII whitespace however wide its ranges; and ECMAScript's
    ``$`` is the end of the text, not of a line."""
    categories = _CATEGORY.search(expr) is not None
    out: list[str] = []
    opened: list[int | None] = []  # where each open [...] began in out, if it takes characters
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            m = _CATEGORY.match(expr, i)
            out.append(f"[\\p{{{m[1][0]}}}&&[^{_UNICODE_16}]]" if m else expr[i : i + 2])
            i = m.end() if m else i + 2
            continue
        if c == "[":
            positive = not opened and not categories and expr[i + 1] != "^"
            opened.append(len(out) if positive else None)
        elif c == "]" and opened:
            start = opened.pop()
            if start is not None and any(ord(ch) > 0x7F for ch in "".join(out[start:])):
                c = f"&&[^{_WIDE_SPACES}]]"
        elif c == "$" and not opened:
            c = "\\z"
        out.append(c)
        i += 1
    return "".join(out)


def _split_steps(kind: str) -> list[Any]:
    """tokenizers pre-tokenizer steps doing what llama.cpp's regexes of ``kind`` do."""
    steps: list[Any] = []
    for expr in _PRE_REGEXES[kind]:
        pattern, behavior = _CUSTOM.get(expr, (expr, "isolated"))
        steps.append(pre_tokenizers.Split(Regex(_onig(pattern)), behavior=behavior))
    return steps


# Token texts llama.cpp treats as end-of-generation whatever their declared type.
_EOG_TEXTS = (
    *[
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
    ],
    *[
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
    ],
    *[
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    ],
)
# Texts llama.cpp picks the EOT token from when the file names none (in its preference order).
_EOT_TEXTS = (
    *["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>"],
    *["<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"],
)
_EOM_TEXTS = ("<|eom_id|>",)
# Rendered as user-defined text by llama.cpp (gpt-oss channel markup).
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# End markers of vocabularies whose </s> is ordinary text (Gemma 4, PLaMo).
_NORMAL_S_MARKERS = ("<|tool_response>", "<|plamo:eos|>")
# Gemma 4's pre-tokenizer: runs of newlines apart from the rest.
_NEWLINE_RUNS = re.compile(r"[^\n]+|\n+")
# C's isspace: what an lstrip token strips.
_C_SPACE = " \t\n\v\f\r"


class _Lowercase(dict[int, str]):
    """str.translate table of llama.cpp's unicode_tolower: one code point for one (a simple
    case mapping: no final sigma, U+0130 to "i"), filled as characters are seen."""

    def __missing__(self, cpt: int) -> str:
        lower = chr(cpt).lower()
        self[cpt] = value = lower if len(lower) == 1 else lower[0]
        return value


_LOWERCASE = _Lowercase()
# encode_within: a text of at most this many characters a token allowed is encoded whole;
# a longer one in pieces of about this many characters per token still allowed (at least
# _PIECE_CHARS), each cut after a letter before a space or newline (``_CUT``).
_WHOLE_CHARS_PER_TOKEN = 8
_PIECE_CHARS_PER_TOKEN = 4
_PIECE_CHARS = 2048
_CUT = re.compile("[^\\W\\d_](?=[ \n\u2581])")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_SURROGATES = re.compile("[\ud800-\udfff]")
_BYTE_DECODER: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_ENCODER: dict[int, str] = _bytes_to_unicode()


def _symbol_pair(byte_level: bool, left: str, right: str) -> str:
    """Two adjacent characters of a text as the vocabulary's tokens spell them where they
    meet: byte-level vocabularies spell bytes (the last of ``left``, the first of
    ``right``); the others spell characters."""
    if not byte_level:
        return left + right
    return (
        _BYTE_ENCODER[left.encode("utf-8", "surrogatepass")[-1]]
        + _BYTE_ENCODER[right.encode("utf-8", "surrogatepass")[0]]
    )


_CACHE: dict[tuple[Any, ...], Tokenizer] = {}
_CACHE_SIZE = 4


class _SplitTable:
    """Special tokens in llama.cpp's partition order, with a quick test for which occur."""

    _KEY = 6
    _MANY = 16  # a group larger than this is looked for where its key occurs

    def __init__(self, entries: list[tuple[str, int]]) -> None:
        self.entries = entries
        # Tokens grouped by their first characters: one substring test rules out a whole
        # group (Gemma has thousands of "<unused…>" tokens).
        self.groups: dict[str, list[int]] = {}
        for k, (text, _) in enumerate(entries):
            self.groups.setdefault(text[: self._KEY], []).append(k)
        # the groups by the first character of their key: a text without "<" is done in one
        # pass, whatever the number of groups
        self.firsts: dict[str, list[str]] = {}
        for key in self.groups:
            self.firsts.setdefault(key[:1], []).append(key)
        # a large group: the texts following each occurrence of its key, looked up in a
        # dict, instead of one pass over the text per token
        self.windows: dict[str, tuple[re.Pattern[str], dict[str, list[int]], list[int]]] = {}
        for key, members in self.groups.items():
            if len(members) > self._MANY:
                texts: dict[str, list[int]] = {}
                for k in members:
                    texts.setdefault(entries[k][0], []).append(k)
                longest = max(map(len, texts))
                window = re.compile(f"(?=({re.escape(key)}.{{0,{longest - len(key)}}}))", re.S)
                self.windows[key] = (window, texts, sorted({len(t) for t in texts}))

    def occurring_in(self, text: str) -> list[tuple[str, int]]:
        found: list[int] = []
        for first, keys in self.firsts.items():
            if first not in text:
                continue
            for key in keys:
                if key not in text:
                    continue
                if key not in self.windows:
                    found += [k for k in self.groups[key] if self.entries[k][0] in text]
                    continue
                window, texts, lengths = self.windows[key]
                seen = set(window.findall(text))
                found += {k for w in seen for n in lengths for k in texts.get(w[:n], ())}
        found.sort()
        return [self.entries[k] for k in found]


class StreamDecoder:
    """Turns generated token ids into text, emitting only complete UTF-8 characters."""

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special: bool = False, keep: Collection[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = frozenset(keep)  # special tokens whose text is kept all the same
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        if (
            self._skip_special
            and self._tokenizer.is_special(token_id)
            and token_id not in self._keep
        ):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of the sequence: an incomplete character held back is dropped (a reply cut by
        the token budget inside a multi-byte character ends before it, not in U+FFFD)."""
        pending, _ = self._utf8.getstate()
        self._utf8.reset()
        return "" if pending else self._utf8.decode(b"", final=True)


class Tokenizer:
    """A GGUF vocabulary: ``encode``/``decode`` that agree with llama.cpp token for token.

    Build it with :meth:`from_gguf`.
    """

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
        lowercase: bool | None = None,
    ) -> None:
        n = len(tokens)
        if n == 0:
            raise TokenizerError("the vocabulary is empty")
        if token_types is not None and len(token_types) < n:
            raise TokenizerError(f"token_type has {len(token_types)} entries for {n} tokens")
        if scores is not None and len(scores) < n:
            raise TokenizerError(f"scores has {len(scores)} entries for {n} tokens")
        # llama.cpp renames empty tokens so that every text maps to one id.
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = (
            [int(t) for t in token_types[:n]] if token_types is not None else [TokenType.NORMAL] * n
        )
        vocab: dict[str, int] = {}
        for i, t in enumerate(texts):
            vocab.setdefault(t, i)

        self.model = model
        self._texts = texts
        # text -> id: the dict while building, then the tokenizer library's own map (a
        # Python dict of a 262k-token vocabulary would hold ~15 MB for the server's life)
        self._lookup: Callable[[str], int | None] = vocab.get
        self._types = types
        self._bytes: list[bytes | None] = [None] * n

        def in_range(i: int | None) -> int | None:
            return i if i is not None and 0 <= i < n else None

        bos_default: int | None
        eos_default: int | None
        unk_default: int | None
        spec: _PreTokenizer | None = None
        if model == "llama":
            self.pre = "default"
            bos_default, eos_default, unk_default = 1, 2, 0
            add_bos_default, space_prefix_default = True, True
        elif model in ("gpt2", "whitespace", "gemma4"):
            # BPE vocabularies: byte-level, or raw UTF-8 (gemma4, and the whitespace-split
            # vocabularies of jina-embeddings-v2-base-zh). llama.cpp reads no pre-tokenizer
            # name from a gemma4 file.
            if model == "gemma4":
                self.pre = "gemma4"
            elif pre:
                self.pre = pre
            else:
                log.warning(
                    "pre_tokenizer_missing",
                    using="default",
                    detail="tokenizer.ggml.pre is missing or empty: generation quality may "
                    "suffer; regenerate the GGUF with a recent llama.cpp converter",
                )
                self.pre = "default"
            spec = _PRE_NAMES.get(self.pre)
            if spec is None:
                raise TokenizerError(
                    f"unknown pre-tokenizer type {self.pre!r} (llama.cpp refuses it too; the "
                    "names it knows are listed in docs/tokenizers.md and in "
                    "lmserve_core.tokenizer.PRE_TOKENIZER_NAMES)"
                )
            add_bos_default, space_prefix_default = spec.add_bos, False
            if model == "gemma4":
                bos_default = eos_default = unk_default = None
            else:
                bos_default, eos_default, unk_default = 11 if spec.bos else None, 11, None
            if merges is None and spec.type == "kimi_k2":
                merges = []  # llama.cpp loads Kimi K2's vocabulary without merges
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r}")

        # An id outside the vocabulary is ignored in favour of the default, as in llama.cpp.
        self.bos_id = in_range(bos_id) if in_range(bos_id) is not None else in_range(bos_default)
        self.eos_id = in_range(eos_id) if in_range(eos_id) is not None else in_range(eos_default)
        self.unk_id = in_range(unk_id) if in_range(unk_id) is not None else in_range(unk_default)
        self.add_bos = add_bos_default if add_bos is None else bool(add_bos)
        if spec is not None and spec.type == "gemma4":
            self.add_bos = True  # llama.cpp overrides the file for Gemma 4's pre-tokenizer
        self.add_eos = False if add_eos is None else bool(add_eos)
        # Only SentencePiece vocabularies prepend a space; decode() removes it (whatever the
        # model, as llama_detokenize does).
        self.add_space_prefix = (
            space_prefix_default if add_space_prefix is None else bool(add_space_prefix)
        )
        # llama_detokenize's clean-up of spaces before punctuation (decode(clean_spaces=True))
        # and llama.cpp's add_sep, as llama.cpp sets them for this vocabulary.
        self.clean_spaces = spec.clean_spaces if spec is not None else False
        self.add_sep = spec.add_sep if spec is not None else False
        self._escape = spec is not None and spec.escape_whitespaces
        self._byte_level = spec is not None and spec.type not in _RAW_UTF8
        self._newline_tokens = spec is not None and spec.type == "gemma4"
        # The whitespace model lowercases unless told not to; its own pre-tokenizer says not to.
        self._lowercase = model == "whitespace" and (
            self.pre != "whitespace" if lowercase is None else bool(lowercase)
        )
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("add_bos_token is true but there is no BOS token")

        self.eot_id = in_range(eot_id) if eot_id is not None else self._find(_EOT_TEXTS)
        self.eom_id = in_range(eom_id) if eom_id is not None else self._find(_EOM_TEXTS)
        eog = {vocab[t] for t in _EOG_TEXTS if t in vocab}
        # llama.cpp forces these to control type whatever the file declares.
        for i in eog:
            types[i] = TokenType.CONTROL
        eog.update(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None)
        # Gemma 4 (and PLaMo) have a </s> that is ordinary text: llama.cpp keeps it out of
        # the end-of-generation set when their own end markers are in it.
        s_id = vocab.get("</s>")
        if s_id in eog and any(texts[i] in _NORMAL_S_MARKERS for i in eog):
            eog.discard(s_id)
            types[s_id] = TokenType.NORMAL
        for text in _ALWAYS_USER_DEFINED:
            if text in vocab:
                types[vocab[text]] = TokenType.USER_DEFINED
        self.eog_ids: frozenset[int] = frozenset(eog)
        # Tokens that take the whitespace before them when split out (llama.cpp's lstrip).
        lstrip = isinstance(pre, str) and any(name in pre for name in _MASK_LSTRIP_PRES)
        self._lstrip = frozenset([vocab["<mask>"]] if lstrip and "<mask>" in vocab else [])

        # Split-out tokens, longest first as llama.cpp orders them.
        special = [
            i
            for i, t in enumerate(types)
            if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        ]
        special.sort(key=lambda i: -len(texts[i].encode("utf-8")))
        self._split_all = _SplitTable([(texts[i], i) for i in special])
        self._split_user = _SplitTable(
            [(texts[i], i) for i in special if types[i] == TokenType.USER_DEFINED]
        )

        if spec is None:
            self._hf = _build_spm(texts, vocab, scores, self.unk_id)
        elif merges is None:
            raise TokenizerError(f"a {model} (BPE) vocabulary needs tokenizer.ggml.merges")
        else:
            steps = _split_steps(spec.type)
            if model == "whitespace":
                # llama.cpp's whitespace session: words between whitespace, which is dropped
                steps.insert(0, pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"))
            self._hf = _build_bpe(vocab, merges, steps, spec.ignore_merges, self._byte_level)
        self._lookup = self._hf.token_to_id

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> Tokenizer:
        """Build the tokenizer described by a GGUF's ``tokenizer.ggml.*`` metadata.

        Tokenizers are immutable, so one built from the same unchanged file is reused
        (a large SentencePiece vocabulary takes a few seconds to build).
        """
        try:
            st = os.stat(gguf_file.path)
            key: tuple[Any, ...] | None = (
                str(gguf_file.path),
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            )
        except OSError:
            key = None
        if key is not None and key in _CACHE:
            return _CACHE[key]
        tokenizer = cls._from_metadata(gguf_file)
        if key is not None:
            while len(_CACHE) >= _CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = tokenizer
        return tokenizer

    @classmethod
    def _from_metadata(cls, gguf_file: GGUFFile) -> Tokenizer:
        g = gguf_file.get
        model = g("tokenizer.ggml.model")
        tokens = g("tokenizer.ggml.tokens")
        if not isinstance(model, str):
            raise TokenizerError(f"{gguf_file.path}: tokenizer.ggml.model is missing")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens[:1]):
            raise TokenizerError(f"{gguf_file.path}: tokenizer.ggml.tokens is missing")

        def opt_int(key: str) -> int | None:
            v = g(key)
            return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

        def opt_bool(key: str) -> bool | None:
            v = g(key)
            return bool(v) if isinstance(v, bool | int) else None

        pre = g("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise TokenizerError(f"{gguf_file.path}: tokenizer.ggml.pre is not a string")
        try:
            return cls(
                model=model,
                tokens=tokens,
                token_types=g("tokenizer.ggml.token_type"),
                scores=g("tokenizer.ggml.scores"),
                merges=g("tokenizer.ggml.merges"),
                pre=pre,
                bos_id=opt_int("tokenizer.ggml.bos_token_id"),
                eos_id=opt_int("tokenizer.ggml.eos_token_id"),
                eot_id=opt_int("tokenizer.ggml.eot_token_id"),
                eom_id=opt_int("tokenizer.ggml.eom_token_id"),
                unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
                add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
                add_eos=opt_bool("tokenizer.ggml.add_eos_token"),
                add_space_prefix=opt_bool("tokenizer.ggml.add_space_prefix"),
                lowercase=opt_bool("tokenizer.ggml.normalizer.lowercase"),
            )
        except TokenizerError as exc:
            raise TokenizerError(f"{gguf_file.path}: {exc}") from None

    # -- queries ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly ``text``, if there is one."""
        return self._lookup(text)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary."""
        return self._texts[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: the ones ``decode(skip_special=True)`` drops."""
        return self._types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN)

    # -- encode -------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        plain: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_special`` adds BOS (and EOS) when the vocabulary asks for them;
        ``parse_special`` lets control-token texts such as ``<|im_start|>`` become their ids
        (user-defined tokens always do, as in llama.cpp), except inside the character spans
        ``plain`` (start, end), where they stay text: e.g. what a message supplied, in a
        rendered chat prompt.
        """
        return self._encode(text, add_special, parse_special, plain, None)

    def encode_within(
        self,
        text: str,
        most: int,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        plain: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """:meth:`encode`, for a text that may be far longer than ``most`` tokens: the same
        ids when there are at most ``most`` of them, else :class:`TooManyTokens` with a lower
        bound of their count. The work is bounded by ``most``, not by the length of the text.

        No token stands for more bytes than the vocabulary's longest, so a text of more
        than ``most`` times as many bytes is refused before any tokenization. A text of up
        to ``_WHOLE_CHARS_PER_TOKEN`` characters a token allowed is encoded whole; a longer
        one in pieces, counting as it goes and stopping once the count passes ``most``. A
        piece ends after a letter followed by a space or a newline that no token of the
        vocabulary joins: every pre-tokenizer splits there (a letter run ends, and no
        pattern carries a letter on into whitespace), so the pieces' ids are the whole
        text's ids. Special-token texts are split out first, never cut.
        """
        added = self._added(add_special)
        # bytes >= characters: the cheap bound first, the exact byte count when it matters
        at_least = added + self.fewest_tokens(len(text))
        if at_least <= most and not text.isascii():
            at_least = added + self.fewest_tokens(len(text.encode("utf-8", "surrogatepass")))
        if at_least > most:
            raise TooManyTokens(at_least, most)
        if len(text) <= _WHOLE_CHARS_PER_TOKEN * max(most, 1):
            ids = self._encode(text, add_special, parse_special, plain, None)
            if len(ids) > most:
                raise TooManyTokens(len(ids), most, exact=True)
            return ids
        return self._encode(text, add_special, parse_special, plain, most)

    @functools.cached_property
    def longest_token(self) -> int:
        """At least as many bytes as any token stands for (and 1). A byte-level token
        stands for the bytes it decodes to; any other for at most its text's UTF-8 (an
        escaped space "\u2581" may stand for a typed "\u2581" as well as for a space).
        Tokens that decode to nothing (unused, undefined) count their text."""
        utf8 = [len(t.encode("utf-8", "surrogatepass")) for t in self._texts]
        if self._byte_level:
            return max(1, max(len(self._piece(i)) or n for i, n in enumerate(utf8)))
        return max(1, max(max(len(self._piece(i)), n) for i, n in enumerate(utf8)))

    def fewest_tokens(self, size: int) -> int:
        """A lower bound of the tokens of any text of ``size`` bytes (or characters, which
        are no more): none stands for more than :attr:`longest_token` bytes. 0 where text
        may be dropped instead of tokenized (whitespace of the whitespace model, before an
        lstrip token)."""
        if self.model == "whitespace" or self._lstrip:
            return 0
        return -(-size // self.longest_token)

    def _added(self, add_special: bool) -> int:
        """How many tokens ``add_special`` adds (BOS, EOS)."""
        if not add_special:
            return 0
        return int(self.add_bos and self.bos_id is not None) + int(
            self.add_eos and self.eos_id is not None
        )

    def _encode(
        self,
        text: str,
        add_special: bool,
        parse_special: bool,
        plain: Sequence[tuple[int, int]],
        most: int | None,
    ) -> list[int]:
        """:meth:`encode`; with ``most``, raising :class:`TooManyTokens` as soon as more
        than ``most`` ids are out (:meth:`encode_within`)."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition_spans(text, parse_special, plain):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                if most is not None and len(out) > most:
                    raise TooManyTokens(len(out), most)
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", "\u2581")
            elif self._escape:
                frag = frag.replace(" ", "\u2581")
            elif self._lowercase:
                frag = frag.translate(_LOWERCASE)
            if self._newline_tokens:
                # Gemma 4: split at newline runs; a run that is a token of its own is that token
                for match in _NEWLINE_RUNS.finditer(frag):
                    word = match.group()
                    tid = self._lookup(word) if word[0] == "\n" else None
                    if tid is not None:
                        out.append(tid)
                    else:
                        self._extend(out, word, most)
            else:
                self._extend(out, frag, most)
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        if most is not None and len(out) > most:
            raise TooManyTokens(len(out), most)
        return out

    def _extend(self, out: list[int], text: str, most: int | None) -> None:
        """Append the ids of ``text`` (one fragment, as the model's merges read it) to
        ``out``; with ``most``, in pieces, stopping once more than ``most`` ids are out."""
        if most is None or len(text) <= _PIECE_CHARS:
            out.extend(self._bpe(text))
            if most is not None and len(out) > most:
                raise TooManyTokens(len(out), most)
            return
        pos = 0
        while pos < len(text):
            want = max(_PIECE_CHARS, _PIECE_CHARS_PER_TOKEN * (most + 1 - len(out)))
            end = self._cut(text, pos + want)
            out.extend(self._bpe(text[pos:end]))
            if len(out) > most:
                raise TooManyTokens(len(out), most)
            pos = end

    def _cut(self, text: str, start: int) -> int:
        """The first place at or after ``start`` where ``text`` can be cut without changing
        its ids (see :meth:`encode_within`), else its end."""
        joined = self._joined_before_space
        for match in _CUT.finditer(text, max(0, start - 1)):
            end = match.end()
            if _symbol_pair(self._byte_level, text[end - 1], text[end]) not in joined:
                return end
        return len(text)

    @functools.cached_property
    def _joined_before_space(self) -> frozenset[str]:
        """The symbol pairs (a character, then a space, newline or "\u2581" as the
        vocabulary spells them) that some token holds: cuts between them are not safe."""
        after = "".join(sorted({_symbol_pair(self._byte_level, "a", c)[1] for c in " \n\u2581"}))
        blob = "\x00".join(self._texts)
        return frozenset(re.findall(f"(?=([^\x00][{re.escape(after)}]))", blob))

    def _bpe(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode holds it throughout): a long text does not
        # stall the other threads (the inference worker, the event loop).
        try:
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:
            # Lone surrogates (possible in JSON input) are not encodable text.
            text = _SURROGATES.sub("\ufffd", text)
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

    def control_texts_in(self, text: str) -> list[str]:
        """The texts of control tokens (those only ``parse_special`` splits out) that occur
        in ``text``, longest first."""
        user = {tok for tok, _ in self._split_user.occurring_in(text)}
        return [tok for tok, _ in self._split_all.occurring_in(text) if tok not in user]

    def _partition_spans(
        self, text: str, parse_special: bool, plain: Sequence[tuple[int, int]]
    ) -> list[str | int]:
        if not plain or not parse_special:
            return self._partition(text, parse_special)
        frags: list[str | int] = []
        pos = 0
        for start, end in sorted(plain):
            start, end = max(start, pos), min(end, len(text))
            if start >= end:
                continue
            frags += self._partition(text[pos:start], True)
            frags += self._partition(text[start:end], False)
            pos = end
        frags += self._partition(text[pos:], True)
        # text on both sides of a span is one fragment, tokenized as a whole (joined once:
        # a prompt of many spans must not copy its text again for each one)
        merged: list[str | int] = []
        run: list[str] = []
        for f in frags:
            if isinstance(f, str):
                run.append(f)
                continue
            if run:
                merged.append("".join(run))
                run = []
            merged.append(f)
        if run:
            merged.append("".join(run))
        return merged

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        if not text:
            return []
        table = self._split_all if parse_special else self._split_user
        frags: list[str | int] = [text]
        for tok, tid in table.occurring_in(text):
            nxt: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    nxt.append(f)
                    continue
                parts = f.split(tok)
                for k, part in enumerate(parts):
                    if k:
                        nxt.append(tid)
                    if tid in self._lstrip and k < len(parts) - 1:
                        part = part.rstrip(_C_SPACE)
                    if part:
                        nxt.append(part)
            frags = nxt
        return frags

    # -- decode -------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (control tokens: their text)."""
        cached = self._bytes[token_id]
        if cached is None:
            cached = self._bytes[token_id] = self._piece(token_id)
        return cached

    def _piece(self, i: int) -> bytes:
        text, kind = self._texts[i], self._types[i]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if kind == TokenType.BYTE:
            return bytes([int(text[3:5], 16)])
        if kind != TokenType.NORMAL:
            return b""  # unused/undefined tokens print nothing in llama.cpp
        if self.model == "llama" or self._escape:
            return text.replace("\u2581", " ").encode("utf-8")
        if not self._byte_level:
            # (llama.cpp would read GPT-2 byte characters here and garble the text)
            return text.encode("utf-8")
        try:
            return bytes(_BYTE_DECODER[c] for c in text)
        except KeyError:
            return text.encode("utf-8")

    def decode(
        self, ids: Iterable[int], *, skip_special: bool = False, clean_spaces: bool = False
    ) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD.

        As in llama.cpp, the space a SentencePiece vocabulary (or any with add_space_prefix)
        puts in front of the text is removed from the first token, unless that token is a
        BOS dropped by ``skip_special``.
        ``clean_spaces`` applies llama_detokenize's clean-up (" ." to ".", " 's" to "'s", ...)
        where llama.cpp does it for this vocabulary (:attr:`clean_spaces`); the text no longer
        tokenizes back to ``ids`` then.
        """
        ids = list(ids)
        strip_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
            strip_space = False
        parts: list[bytes] = []
        for n, tid in enumerate(ids):
            if skip_special and self.is_special(tid):
                continue
            piece = self.token_bytes(tid)
            if n == 0 and strip_space and piece.startswith(b" "):
                piece = piece[1:]
            parts.append(piece)
        text = b"".join(parts)
        if clean_spaces and self.clean_spaces:
            text = _clean_up_spaces(text)
        return text.decode("utf-8", errors="replace")

    def stream_decoder(
        self, *, skip_special: bool = False, keep: Collection[int] = ()
    ) -> StreamDecoder:
        """A decoder for one generated sequence (see :class:`StreamDecoder`); ``keep``: special
        tokens whose text it keeps when it skips the others."""
        return StreamDecoder(self, skip_special=skip_special, keep=keep)

    def _find(self, texts: Iterable[str]) -> int | None:
        for t in texts:
            i = self._lookup(t)
            if i is not None:
                return i
        return None

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


def _clean_up_spaces(text: bytes) -> bytes:
    """llama_detokenize's three clean-up passes (clean_up_tokenization_spaces), in place on
    the bytes as llama.cpp runs them."""
    buf = bytearray(text)
    # a space before ? ! . , goes
    n, total = len(buf), min(len(buf), 1)
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    # " ' " becomes "'"
    n, total, i = total, min(total, 1), 1
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    # " 's" " 'm" " 're" " 've" lose the space
    n, total = total, min(total, 1)
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            after = bytes(buf[i + 1 : min(i + 3, n)])
            if after[:1] in (b"s", b"m") or after in (b"re", b"ve"):
                total -= 1
        buf[total] = x
        total += 1
    return bytes(buf[:total])


def _merge_pairs(vocab: dict[str, int], merge_lines: Sequence[str]) -> list[tuple[str, str]]:
    """The merges of a BPE vocabulary as pairs, in rank order."""
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for line in merge_lines:
        # Split at the first space after position 0, as llama.cpp does.
        pos = line.find(" ", 1)
        if pos < 0:
            continue
        pair = (line[:pos], line[pos + 1 :])
        # The first rank of a repeated pair wins; merges that make no known token would
        # only fall back to bytes in llama.cpp, which byte-level pieces give anyway.
        if pair in seen or pair[0] + pair[1] not in vocab:
            continue
        if pair[0] not in vocab or pair[1] not in vocab:
            continue
        seen.add(pair)
        merges.append(pair)
    return merges


def _build_bpe(
    vocab: dict[str, int],
    merge_lines: Sequence[str],
    steps: list[Any],
    ignore_merges: bool,
    byte_level: bool,
) -> HFTokenizer:
    """A BPE after the pre-tokenizer ``steps``: over GPT-2's byte characters, or over raw
    UTF-8 with ``<0xXX>`` tokens for what no token spells."""
    merges = _merge_pairs(vocab, merge_lines)
    model = models.BPE(
        vocab=vocab, merges=merges, ignore_merges=ignore_merges, byte_fallback=not byte_level
    )
    tok = HFTokenizer(model)
    if byte_level:
        steps = [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return tok


def _build_spm(
    texts: list[str],
    vocab: dict[str, int],
    scores: Sequence[float] | None,
    unk_id: int | None,
) -> HFTokenizer:
    if scores is None:
        scores = [0.0] * len(texts)
    # llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is
    # the highest-scoring vocabulary entry. A BPE whose merges are all such pairs, ranked by
    # that score, performs the same merges in the same order.
    # (A stable sort keeps equal scores in id order.)
    if isinstance(scores, np.ndarray):
        order = np.argsort(-scores[: len(texts)].astype(np.float64), kind="stable").tolist()
    else:
        order = sorted(range(len(texts)), key=scores.__getitem__, reverse=True)
    merges: list[tuple[str, str]] = []
    extend = merges.extend
    for i in order:
        t = texts[i]
        if len(t) < 2 or vocab[t] != i:
            continue
        extend([(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab])
    unk = texts[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True)
    return HFTokenizer(model)
