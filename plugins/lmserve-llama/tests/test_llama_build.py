"""The cffi build script: its cdef region and the kernel flags it takes from the core."""

from __future__ import annotations

from lmserve_llama import build

import lmserve_core.native as native


def test_cdef_region_is_plain_declarations() -> None:
    cdef = build._cdef(build._HEADER)
    assert "int llama_forward(" in cdef and "llama_cache_copy_rows" in cdef
    assert not any(line.lstrip().startswith("#") for line in cdef.splitlines())


def test_module_embeds_the_core_kernels_with_their_flags() -> None:
    kwargs = build._kwargs
    assert kwargs["extra_compile_args"] == native.compile_args()
    assert native.get_include() in kwargs["include_dirs"]
    assert build._CSRC in kwargs["include_dirs"]
