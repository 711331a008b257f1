"""cffi build script of ``lmserve_core._kernels`` (out-of-line API mode).

setup.py runs it through ``cffi_modules``; for development run it directly from the repository
root to build the module in place::

    python lmserve_core/native/build.py
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent


def _load_native():  # type: ignore[no-untyped-def]
    # Load the flag helpers by path: importing the lmserve_core package at build time could
    # pull in runtime dependencies that are not installed yet.
    spec = importlib.util.spec_from_file_location("_lmserve_native", _HERE / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_native = _load_native()

ffibuilder = FFI()
ffibuilder.cdef(_native.get_cdef())
ffibuilder.set_source(
    "lmserve_core._kernels",
    _native.kernels_source(),
    # the full ABI tag, so setup.py and build_in_place() produce the same file name
    py_limited_api=False,
    **_native.build_kwargs(),
)


def build_in_place() -> Path:
    """Compile the module and copy it next to the package's sources; returns its path."""
    package_dir = _HERE.parent
    with tempfile.TemporaryDirectory(prefix="lmserve-kernels-") as tmp:
        built = Path(ffibuilder.compile(tmpdir=tmp, verbose=False))
        target = package_dir / built.name
        shutil.copy2(built, target)
    return target


if __name__ == "__main__":
    print(build_in_place(), file=sys.stderr)
