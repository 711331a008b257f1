"""llama.cpp's pre-tokenizers: the regexes and settings each ``tokenizer.ggml.pre`` name gets.

llm_tokenizer_bpe splits a text with the regexes of the name's type before any merge; here
the same regexes run as ``tokenizers`` pre-tokenizer steps (:func:`_split_steps`), rewritten
where llama.cpp runs C++ instead of a regex or reads a regex differently from Oniguruma
(:func:`_onig`). The names llama.cpp knows are listed in docs/tokenizers.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, pre_tokenizers

__all__ = ["PRE_TOKENIZER_NAMES"]

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
