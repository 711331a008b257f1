"""Locations, compiler flags and cffi declarations of the native kernels and the family kit.

The core compiles the kernels once, into ``lmserve_core._kernels``. A family plugin compiles
only its own forward pass, against the kit header (``lmserve/kit.h``), and reaches the
kernels through the table the core hands over at load: :func:`family_ffibuilder` sets that
up. Build scripts import this module at build time, so it stays light: no compiled code, no
third-party imports besides cffi (imported by :func:`family_ffibuilder` only). The Python API
over the compiled kernels is :mod:`lmserve_core.native.kernels`.

Build switches (environment variables, read when the flags are computed):

``LMSERVE_NATIVE_DEBUG=1``
    build with ``-O0 -g`` instead of ``-O3``.
``LMSERVE_NATIVE_PORTABLE=1``
    leave out the x86 SIMD paths (portable C only).
``LMSERVE_NATIVE_SANITIZE=1``
    build under AddressSanitizer and UndefinedBehaviorSanitizer (``-O1 -g``, portable C only:
    the instrumented SIMD paths take many minutes to compile); a Python process loading such
    a module needs ``LD_PRELOAD`` of libasan (``nox -s sanitize`` sets it up).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_INCLUDE = _HERE / "include"

_TRUE = {"1", "true", "yes", "on"}

# -ffp-contract=off: no silent FMA contraction, so the portable decoders round exactly like
# the GGML/gguf references and every ISA path is deterministic. -fvisibility=hidden keeps the
# lm_* symbols private to each extension module. -Wall -Wextra: the native code builds
# without a warning (cffi's generated wrappers included).
_BASE_FLAGS = [
    "-std=gnu11",
    "-Wall",
    "-Wextra",
    "-Werror=implicit-function-declaration",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fvisibility=hidden",
]

# The sanitizers of LMSERVE_NATIVE_SANITIZE: undefined behaviour stops the process like a
# memory error does.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]

CDEF_BEGIN = "/* cdef-begin */"
CDEF_END = "/* cdef-end */"


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


def get_include() -> str:
    """Directory to add to the include path; it holds ``lmserve/kit.h`` and friends."""
    return str(_INCLUDE)


def get_sources() -> list[str]:
    """Absolute paths of the kernel C sources (compiled by the core only), sorted."""
    return sorted(str(p) for p in (_HERE / "src").glob("*.c"))


def cdef_region(header: str | os.PathLike[str]) -> str:
    """The cffi declarations of a header: the text between its cdef markers.

    The region must hold plain C declarations (no preprocessor lines); every lmserve header
    and every family header marks its region this way, so the C header stays the one
    source of the declarations.
    """
    text = Path(header).read_text(encoding="utf-8")
    try:
        begin = text.index(CDEF_BEGIN) + len(CDEF_BEGIN)
        end = text.index(CDEF_END, begin)
    except ValueError:
        raise ValueError(f"{header}: no {CDEF_BEGIN} ... {CDEF_END} region") from None
    return text[begin:end]


def types_cdef() -> str:
    """Declarations of the shared types (``lmserve/types.h``): every module needs them."""
    return cdef_region(_INCLUDE / "lmserve" / "types.h")


def get_cdef() -> str:
    """The cffi declarations of the core's module: the types and ``lmserve/kernels.h``."""
    return types_cdef() + cdef_region(_INCLUDE / "lmserve" / "kernels.h")


def compile_args(env: Mapping[str, str] | None = None) -> list[str]:
    """C compiler flags of the core's module and of family modules.

    ``env`` defaults to ``os.environ``; see the module docstring for the switches.
    """
    env = os.environ if env is None else env
    flags = list(_BASE_FLAGS)
    sanitize = _flag(env, "LMSERVE_NATIVE_SANITIZE")
    # -O3: the decoders' small fixed loops must unroll into registers (at -O2 GCC keeps them
    # in memory and decode runs at half speed)
    if _flag(env, "LMSERVE_NATIVE_DEBUG"):
        flags += ["-O0", "-g"]
    else:
        flags += ["-O1", "-g"] if sanitize else ["-O3"]
    if sanitize:
        flags += ["-fno-omit-frame-pointer", *SANITIZE_FLAGS]
    if sanitize or _flag(env, "LMSERVE_NATIVE_PORTABLE"):
        flags.append("-DLM_NO_SIMD")
    flags.append("-pthread")
    return flags


def link_args(env: Mapping[str, str] | None = None) -> list[str]:
    """Linker flags of the core's module and of family modules."""
    env = os.environ if env is None else env
    sanitize = _flag(env, "LMSERVE_NATIVE_SANITIZE")
    return ["-pthread", *(SANITIZE_FLAGS[:1] if sanitize else [])]


def build_kwargs(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``FFI.set_source``: include path, flags, libraries."""
    return {
        "include_dirs": [get_include()],
        "extra_compile_args": compile_args(env),
        "extra_link_args": link_args(env),
        "libraries": ["m"],
    }


def kernels_source() -> str:
    """C text of the core's module: the whole kernel library as one translation unit."""
    return '#include "lmserve/kernels.h"\n#include "lmserve/kernels_impl.h"\n'


# What every family module exposes besides its own header's region: the binding entry.
_KIT_CDEF = "int lm_kit_bind(const void *table);\n"


def family_ffibuilder(
    module_name: str,
    header: str | os.PathLike[str],
    sources: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
) -> Any:
    """A ``cffi.FFI`` that builds a family's forward-pass module against the kit.

    ``header`` is the family's header (its cdef region declares the config and weight
    structs and the build function); ``sources`` are the family's C files, relative to the
    directory setuptools runs in (the plugin's root). The module binds to the core's kernels
    at import (:class:`lmserve_core.kit.NativeForwardModel` does it); it compiles none of them.
    """
    from cffi import FFI

    header_path = Path(header).resolve()
    ffi = FFI()
    ffi.cdef(types_cdef() + _KIT_CDEF + cdef_region(header_path))
    kwargs = build_kwargs(env)
    kwargs["include_dirs"] = [*kwargs["include_dirs"], str(header_path.parent)]
    ffi.set_source(
        module_name,
        f'#define LM_KIT_MAIN\n#include "lmserve/kit.h"\n#include "{header_path.name}"\n',
        sources=[str(s) for s in sources],
        # the full ABI tag, so setup.py and an in-place build produce the same file name
        py_limited_api=False,
        **kwargs,
    )
    return ffi


def family_ffibuilder_for(
    build_file: str | os.PathLike[str], *names: str, env: Mapping[str, str] | None = None
) -> Any:
    """:func:`family_ffibuilder` for a plugin laid out as the families are: ``build_file`` is
    its ``<package>/build.py`` (pass ``__file__``), the module is ``<package>._forward``, and
    for each of ``names`` the plugin's ``csrc/<name>_forward.c`` is compiled, the first
    one's ``csrc/<name>_forward.h`` declaring the module::

        ffibuilder = family_ffibuilder_for(__file__, "gemma", "gemma4")
    """
    if not names:
        raise ValueError("a family module compiles at least one csrc/<name>_forward.c")
    package = Path(build_file).resolve().parent
    csrc = package.parent / "csrc"
    return family_ffibuilder(
        f"{package.name}._forward",
        csrc / f"{names[0]}_forward.h",
        # setuptools wants sources relative to the directory it runs in (the plugin's root)
        [os.path.relpath(csrc / f"{name}_forward.c") for name in names],
        env=env,
    )
