"""cffi build of ``lmserve_qwen35._forward``: the Qwen3.5 forward pass over the core's kit.

Run by setuptools (``setup.py``'s ``cffi_modules``) with the plugin's root as the working
directory; only ``lmserve_core.native`` must be importable at build time.
"""

from __future__ import annotations

import os

import lmserve_core.native as native

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

ffibuilder = native.family_ffibuilder(
    "lmserve_qwen35._forward",
    os.path.join(_CSRC, "qwen35_forward.h"),
    # setuptools wants sources relative to setup.py
    [os.path.relpath(os.path.join(_CSRC, "qwen35_forward.c"))],
)
