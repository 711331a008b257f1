"""Locations and compiler flags of the shared native kernels.

Plugin build scripts import this at build time to compile the kernels into their own cffi
module, so it must stay light: no compiled code, no third-party imports. The Python API over
the core's own compiled module is :mod:`lmserve_core.native.kernels`.

Build switches (environment variables, read when the flags are computed):

``LMSERVE_NATIVE_DEBUG=1``
    build with ``-O0 -g`` instead of ``-O2``.
``LMSERVE_NATIVE_PORTABLE=1``
    leave out the x86 SIMD paths (portable C only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

_TRUE = {"1", "true", "yes", "on"}

# -ffp-contract=off: no silent FMA contraction, so the portable decoders round exactly like
# the GGML/gguf references and every ISA path is deterministic. -fvisibility=hidden keeps the
# lm_* symbols private to each extension that embeds them.
_BASE_FLAGS = [
    "-std=gnu11",
    "-Werror=implicit-function-declaration",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fvisibility=hidden",
]


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


def get_include() -> str:
    """Directory to add to the include path; it holds ``lmserve/kernels.h``."""
    return str(_HERE / "include")


def get_sources() -> list[str]:
    """Absolute paths of the kernel C sources, sorted."""
    return sorted(str(p) for p in (_HERE / "src").glob("*.c"))


def get_cdef() -> str:
    """The cffi declarations of ``kernels.h`` (for ``ffibuilder.cdef``)."""
    return (_HERE / "kernels.cdef").read_text()


def compile_args(env: Mapping[str, str] | None = None) -> list[str]:
    """C compiler flags every module embedding the kernels must use.

    ``env`` defaults to ``os.environ``; see the module docstring for the switches.
    """
    env = os.environ if env is None else env
    flags = list(_BASE_FLAGS)
    flags += ["-O0", "-g"] if _flag(env, "LMSERVE_NATIVE_DEBUG") else ["-O2"]
    if _flag(env, "LMSERVE_NATIVE_PORTABLE"):
        flags.append("-DLM_NO_SIMD")
    flags.append("-pthread")
    return flags


def embed_source() -> str:
    """C text that compiles the whole kernel library into the including module.

    Put it at the top of the source string given to ``FFI.set_source`` together with
    :func:`build_kwargs`; no kernel files need to be listed as sources (setuptools refuses
    absolute source paths, and the kernels live in another package).
    """
    return '#include "lmserve/kernels.h"\n#include "lmserve/kernels_impl.h"\n'


def link_args() -> list[str]:
    """Linker flags every module embedding the kernels must use."""
    return ["-pthread"]


def build_kwargs(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``FFI.set_source`` that, with :func:`embed_source`, compile the
    kernels into a module. Add your own sources and flags to the lists it returns.
    """
    return {
        "include_dirs": [get_include()],
        "extra_compile_args": compile_args(env),
        "extra_link_args": link_args(),
        "libraries": ["m"],
    }
