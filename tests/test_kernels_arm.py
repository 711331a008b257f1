"""The kernels on AArch64, without Arm hardware: tests/native/check_products.c built with the
whole kernel library by Debian's cross compiler and run under qemu-user as three CPUs, one
with FEAT_DotProd and FEAT_I8MM (``max``), one with FEAT_DotProd alone (``neoverse-n1``,
Graviton 2, Ampere Altra) and one with neither (``cortex-a72``, Raspberry Pi 4). Each SIMD
path's products of every interleaved type must have the portable products' bits for every
token count up to 70 and 1 to 3 threads. The tools are installed by ``nox -s tests`` (as
root, with apt); without them the tests skip, except under CI, where they fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmserve_core import native

HARNESS = Path(__file__).parent / "native" / "check_products.c"
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64-static"
SYSROOT = "/usr/aarch64-linux-gnu"


def _require_tools() -> None:
    missing = [tool for tool in (CC, QEMU) if shutil.which(tool) is None]
    if not missing:
        return
    reason = f"{', '.join(missing)} not installed (Debian: gcc-aarch64-linux-gnu qemu-user-static)"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"the AArch64 checks cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def arm_binary(tmp_path_factory) -> Path:
    _require_tools()
    out = tmp_path_factory.mktemp("arm") / "check_products"
    flags = [f for f in native.compile_args({}) if f not in ("-O3",)]
    subprocess.run(
        [CC, *flags, "-O2", f"-I{native.get_include()}", str(HARNESS), "-o", str(out), "-lm"],
        check=True, capture_output=True, text=True,
    )
    return out


def run(binary: Path, cpu: str) -> tuple[str, int, int]:
    done = subprocess.run(
        [QEMU, "-L", SYSROOT, "-cpu", cpu, str(binary)],
        capture_output=True, text=True, timeout=600,
    )
    tail = re.search(r"^(\d+) passed, (\d+) failed$", done.stdout, re.M)
    assert tail is not None, done.stdout + done.stderr
    return done.stdout, int(tail[1]), int(tail[2])


@pytest.mark.parametrize(
    ("cpu", "paths"),
    [("max", {0, 3, 4}), ("neoverse-n1", {0, 3}), ("cortex-a72", {0})],
)
def test_every_arm_path_has_the_portable_bits(arm_binary: Path, cpu: str, paths: set[int]) -> None:
    out, passed, failed = run(arm_binary, cpu)
    available = {int(p) for p in re.search(r"available:([ \d]*)", out)[1].split()}
    # the paths come from the CPU's own report (getauxval): each emulated CPU gets its own
    assert available == paths, out
    assert failed == 0, out
    assert passed == (len(paths) - 1) * 230, out  # every check of every SIMD path ran
