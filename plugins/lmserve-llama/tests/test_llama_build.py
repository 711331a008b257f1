"""The cffi build: the family module compiles its forward pass only, against the kit."""

from __future__ import annotations

from pathlib import Path

import lmserve_core._kernels as core
from lmserve_llama import _forward, build

import lmserve_core.native as native


def test_cdef_region_is_plain_declarations() -> None:
    cdef = native.cdef_region(Path(build.__file__).parents[1] / "csrc" / "llama_forward.h")
    assert "int llama_build(" in cdef and "lm_decoder_tensors" in cdef
    assert not any(line.lstrip().startswith("#") for line in cdef.splitlines())


def test_module_builds_against_the_kit_not_a_copy_of_the_kernels() -> None:
    source = build.ffibuilder._assigned_source[1]
    assert '#include "lmserve/kit.h"' in source and "kernels_impl" not in source
    kwargs = build.ffibuilder._assigned_source[3]
    assert kwargs["extra_compile_args"] == native.compile_args()
    assert native.get_include() in kwargs["include_dirs"]
    # the compiled family module carries no kernels: a fraction of the core's size
    family, kernels = Path(_forward.__file__).stat().st_size, Path(core.__file__).stat().st_size
    assert family * 4 < kernels, (family, kernels)
    assert not hasattr(_forward.lib, "lm_matmul") and hasattr(_forward.lib, "lm_kit_bind")
