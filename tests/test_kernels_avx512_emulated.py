"""The AVX-512 kernels without AVX-512 hardware: the native harnesses built with the whole
kernel library and SIMDe standing in for the AVX-512 intrinsics (tests/native/simde_avx512.h),
so that dispatch.c installs the AVX-512 table on an AVX2 CPU. check_kernels_x86.c holds every
entry of that table to the AVX2 (or portable) outputs, check_products.c its products of the
interleaved types (VNNI, VBMI) to the portable bits. On a CPU with AVX-512 the kernels also run
natively. SIMDe is Debian's libsimde-dev, installed by ``nox -s tests``; without it the
emulated tests skip, except under CI, where they fail."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmserve_core import native

NATIVE = Path(__file__).parent / "native"
SIMDE = Path("/usr/include/simde/x86/avx512.h")

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 kernels"
)


def _require_simde() -> None:
    if SIMDE.exists() and shutil.which("gcc"):
        return
    reason = "SIMDe headers not installed (Debian: libsimde-dev)"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"the emulated AVX-512 checks cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def build(harness: str, out: Path, emulate: bool) -> Path:
    # -O0: the emulated intrinsics compile ten times slower than the library at -O1 and more
    flags = [f for f in native.compile_args({}) if f != "-O3"]
    extra = ["-O0", "-mavx2", "-mfma", "-mf16c", "-include", str(NATIVE / "simde_avx512.h")]
    subprocess.run(
        ["gcc", *flags, *(extra if emulate else ["-O2"]), f"-I{native.get_include()}",
         str(NATIVE / harness), "-o", str(out), "-lm"],
        check=True, capture_output=True, text=True,
    )
    return out


def run(binary: Path) -> tuple[str, int, int]:
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    tail = re.search(r"^(\d+) passed, (\d+) failed$", done.stdout, re.M)
    assert tail is not None, done.stdout + done.stderr
    return done.stdout, int(tail[1]), int(tail[2])


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Path:
    _require_simde()
    return tmp_path_factory.mktemp("avx512")


def test_every_avx512_kernel_agrees_with_avx2(emulated: Path) -> None:
    out, passed, failed = run(build("check_kernels_x86.c", emulated / "kernels", True))
    assert failed == 0, out
    assert passed > 6000, out  # every case of every entry ran


def test_avx512_interleaved_products_have_the_portable_bits(emulated: Path) -> None:
    out, passed, failed = run(build("check_products.c", emulated / "products", True))
    assert "available: 0 1 2" in out, out
    assert failed == 0, out
    assert passed == 2 * 230, out  # AVX2 and AVX-512, every check


def test_native_avx512_kernels_when_the_cpu_has_them(tmp_path: Path) -> None:
    binary = build("check_kernels_x86.c", tmp_path / "kernels", False)
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    if done.returncode == 2:
        pytest.skip("no AVX-512 on this CPU")
    assert done.returncode == 0, done.stdout + done.stderr
