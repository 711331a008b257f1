"""The native code without a warning and under the sanitizers.

* Every C source (the kernel library with its SIMD paths, each family's forward) compiles
  under ``-Wall -Wextra -Werror``.
* tests/native/check_kit.c, built with the whole kernel library under AddressSanitizer and
  UndefinedBehaviorSanitizer (portable C, ``-O1``), runs clean: the kit's arena, the decoder's
  hooks, its forward passes, with LeakSanitizer holding every model to freeing all it took.
* With ``LMSERVE_SANITIZE_FULL=1`` (``nox -s sanitize``, which also runs the kernel, kit and
  family numerics tests over sanitized modules) the native harnesses run on this CPU's SIMD
  paths under AddressSanitizer alone (``-O2``: UndefinedBehaviorSanitizer's checks make the
  SIMD kernels take many minutes to compile).

gcc and its sanitizer runtimes come with Debian's gcc; without them the tests skip, except
under CI, where they fail.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmserve_core import native

ROOT = Path(__file__).resolve().parents[1]
NATIVE = Path(__file__).parent / "native"
FULL = os.environ.get("LMSERVE_SANITIZE_FULL", "").lower() in ("1", "true", "yes", "on")
# Leaks are errors; undefined behaviour stops the process (the binaries are built with
# -fno-sanitize-recover) and prints where.
ENV = {
    **os.environ,
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


def _ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def _require(sanitizers: bool = True) -> None:
    reason = None
    if shutil.which("gcc") is None:
        reason = "gcc not installed"
    elif sanitizers:
        for lib in ("libasan.so", "libubsan.so"):
            found = subprocess.run(
                ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True
            ).stdout.strip()
            if not Path(found).is_file():
                reason = f"{lib} not installed (Debian: gcc's libasan8, libubsan1)"
    if reason is None:
        return
    if _ci():
        pytest.fail(f"the native checks cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


def flags(env: dict[str, str] | None = None) -> list[str]:
    """The library's flags with warnings as errors, without its optimisation level."""
    kept = [f for f in native.compile_args(env or {}) if not f.startswith(("-O", "-g"))]
    return [*kept, "-Werror", f"-I{native.get_include()}", f"-I{NATIVE}"]


def build(harness: str, out: Path, extra: list[str], env: dict[str, str] | None = None) -> Path:
    done = subprocess.run(
        ["gcc", *flags(env), *extra, str(NATIVE / harness), "-o", str(out), "-lm"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out


def run(binary: Path) -> tuple[int, str, int, int]:
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600, env=ENV)
    tail = re.search(r"^(\d+) passed, (\d+) failed$", done.stdout, re.M)
    out = done.stdout + done.stderr
    if done.returncode == 2 and tail is None:  # check_kernels_x86.c: no AVX-512 here
        return 2, out, 0, 0
    assert tail is not None, out
    return done.returncode, out, int(tail[1]), int(tail[2])


def test_sanitize_switch() -> None:
    sanitized = native.compile_args({"LMSERVE_NATIVE_SANITIZE": "1"})
    assert "-fsanitize=address,undefined" in sanitized and "-O1" in sanitized
    assert "-O3" not in sanitized and "-DLM_NO_SIMD" in sanitized
    assert "-fsanitize=address,undefined" in native.link_args({"LMSERVE_NATIVE_SANITIZE": "1"})
    assert not any("sanitize" in f for f in native.compile_args({}) + native.link_args({}))
    assert {"-Wall", "-Wextra"} <= set(native.compile_args({}))


def test_native_code_compiles_without_a_warning(tmp_path: Path) -> None:
    _require(sanitizers=False)
    library = tmp_path / "library.c"
    library.write_text(native.kernels_source())
    units = [(library, [])]
    for csrc in sorted(ROOT.glob("plugins/*/csrc")):
        units += [(source, [f"-I{csrc}"]) for source in sorted(csrc.glob("*.c"))]
    assert len(units) >= 8
    for source, extra in units:
        for portable in ({}, {"LMSERVE_NATIVE_PORTABLE": "1"}):
            done = subprocess.run(
                ["gcc", *flags(portable), *extra, "-fsyntax-only", str(source)],
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0 and not done.stderr, f"{source}:\n{done.stderr}"


def test_kit_under_address_and_undefined_sanitizers(tmp_path: Path) -> None:
    _require()
    env = {"LMSERVE_NATIVE_SANITIZE": "1"}
    opt = [
        f
        for f in native.compile_args(env)
        if f.startswith(("-O", "-g", "-fsanitize", "-fno-sanitize", "-fno-omit"))
    ]
    binary = build("check_kit.c", tmp_path / "check_kit", opt, env)
    code, out, passed, failed = run(binary)
    assert code == 0 and failed == 0, out
    assert passed >= 60, out
    assert "ERROR" not in out and "runtime error" not in out, out


@pytest.mark.skipif(not FULL, reason="the SIMD paths under ASan: nox -s sanitize")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 harnesses")
@pytest.mark.parametrize("harness", ["check_kit.c", "check_products.c", "check_kernels_x86.c"])
def test_simd_paths_under_address_sanitizer(harness: str, tmp_path: Path) -> None:
    _require()
    # asan-stack=0: instrumenting the kernels' many vector locals makes the build take minutes
    extra = ["-O2", "-fno-omit-frame-pointer", "-fsanitize=address", "--param", "asan-stack=0"]
    code, out, passed, failed = run(build(harness, tmp_path / harness.removesuffix(".c"), extra))
    if code == 2:
        pytest.skip("no AVX-512 on this CPU")
    assert code == 0 and failed == 0, out
    assert passed > 0, out
