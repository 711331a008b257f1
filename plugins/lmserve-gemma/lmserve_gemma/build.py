"""cffi build of ``lmserve_gemma._forward`` (setup.py's ``cffi_modules``) over the core's kit:
Gemma 3 and Gemma 4."""

from lmserve_core.native import family_ffibuilder_for

ffibuilder = family_ffibuilder_for(__file__, "gemma", "gemma4")
