"""cffi build of ``lmserve_llama._forward``: the llama forward pass over the shared kernels.

Run by setuptools (``setup.py``'s ``cffi_modules``); only ``lmserve_core.native`` must be
importable at build time. The cdef is the marked region of ``csrc/llama_forward.h``.
"""

from __future__ import annotations

import os

from cffi import FFI

import lmserve_core.native as native

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(os.path.dirname(_HERE), "csrc")
_HEADER = os.path.join(_CSRC, "llama_forward.h")


def _cdef(header_path: str) -> str:
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    begin = text.index("/* cdef-begin */") + len("/* cdef-begin */")
    end = text.index("/* cdef-end */")
    return text[begin:end]


# The kernels compile into this module's own translation unit (embed_source), beside the
# family's forward pass; setuptools wants the extension's sources relative to setup.py.
_kwargs = native.build_kwargs()
_kwargs["include_dirs"] = [*_kwargs["include_dirs"], _CSRC]

ffibuilder = FFI()
ffibuilder.cdef(_cdef(_HEADER))
ffibuilder.set_source(
    "lmserve_llama._forward",
    native.embed_source() + '#include "llama_forward.h"\n',
    sources=[os.path.relpath(os.path.join(_CSRC, "llama_forward.c"))],
    **_kwargs,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
