"""cffi build of ``lmserve_llama._forward``: the llama forward pass over the core's kit.

Run by setuptools (``setup.py``'s ``cffi_modules``) with the plugin's root as the working
directory; only ``lmserve_core.native`` must be importable at build time.
"""

from __future__ import annotations

import os

import lmserve_core.native as native

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(os.path.dirname(_HERE), "csrc")

ffibuilder = native.family_ffibuilder(
    "lmserve_llama._forward",
    os.path.join(_CSRC, "llama_forward.h"),
    # setuptools wants sources relative to setup.py
    [os.path.relpath(os.path.join(_CSRC, "llama_forward.c"))],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
