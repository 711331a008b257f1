"""cffi build of ``lmserve_inkling._forward`` (setup.py's ``cffi_modules``) over the core's kit."""

from lmserve_core.native import family_ffibuilder_for

ffibuilder = family_ffibuilder_for(__file__, "inkling")
