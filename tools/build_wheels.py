"""Build the wheels of lmserve-core and the family plugins, the way pip builds them for a user.

    python tools/build_wheels.py [--dist DIR] [PLUGIN_DIR ...]

``nox -s wheels`` runs this; the packaging test calls :func:`build`. The core is built first,
then each plugin (default: every ``plugins/*``), each with ``pip wheel`` under pip's default
build isolation. A plugin's isolated build gets the core wheel just built as its
``lmserve-core`` through a build constraint naming that file, so pip never asks an index
for it (a same-named project on an index cannot stand in for it).

The projects are built from a fresh copy of the files a clean checkout holds: an in-tree
``build/`` is reused by setuptools without noticing changed kernel sources (they are
``#include``d, not listed), and egg-info or the compiled modules of editable installs must
not reach a wheel. Each wheel is checked to hold exactly its package's source files plus
one compiled module. The new wheels replace earlier files of the same projects in DIR
(default ``dist/``). Needs pip >= 25.3 (``--build-constraint``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSION_SUFFIXES = (".so", ".pyd")
_NOT_SOURCES = (*EXTENSION_SUFFIXES, ".pyc", ".o")
# What a checkout without git must not copy: .gitignore's build and cache outputs.
_UNTRACKED = (
    ".git", ".nox", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.py[cod]",
    "*.so", "*.o", "*_cache", "_kernels.c", "_forward.c",
)


def default_plugins(root: Path = ROOT) -> list[str]:
    found = root.glob("plugins/*/pyproject.toml")
    return sorted(p.parent.relative_to(root).as_posix() for p in found)


def snapshot(root: Path, dest: Path) -> None:
    """Copy what a clean checkout of ``root`` holds (plus new, not ignored files) to ``dest``."""
    try:
        cmd = ["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"]
        listed = subprocess.run(cmd, check=True, capture_output=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(root, dest, ignore=shutil.ignore_patterns(*_UNTRACKED))
        return
    for name in filter(None, listed.split("\0")):
        source = root / name
        if source.is_file():  # tracked files deleted in the working tree are listed too
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def pip_wheel(project: Path, out: Path, *, build_constraint: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out)]
    if build_constraint is not None:
        cmd += ["--build-constraint", str(build_constraint)]
    # an absolute path: a bare relative name would be looked up on the index as a project
    subprocess.run([*cmd, str(project.resolve())], check=True)
    built = sorted(set(out.glob("*.whl")) - before)
    if len(built) != 1:
        raise RuntimeError(f"pip wheel {project} produced {[w.name for w in built]}")
    return built[0]


def wheel_problems(wheel: Path, project: Path) -> list[str]:
    """What is wrong with ``wheel``, built from ``project``: files that are not its package's
    sources or its compiled module (build debris), and package files it lacks."""
    with zipfile.ZipFile(wheel) as zf:
        members = {n for n in zf.namelist() if not n.endswith("/")}
    payload = {n for n in members if not n.split("/", 1)[0].endswith(".dist-info")}
    packages = {n.split("/", 1)[0] for n in payload if "/" in n}
    sources = {
        p.relative_to(project).as_posix()
        for package in packages
        for p in (project / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(_NOT_SOURCES)
    }
    compiled = {n for n in payload - sources if n.endswith(EXTENSION_SUFFIXES)}
    extra = payload - sources - compiled
    problems = [f"not from the package's sources: {n}" for n in sorted(extra)]
    problems += [f"missing: {n}" for n in sorted(sources - payload)]
    if len(compiled) != 1:
        problems.append(f"expected one compiled module, found {sorted(compiled)}")
    return problems


def check_pip() -> None:
    version = metadata.version("pip")
    if tuple(int(part) for part in version.split(".")[:2]) < (25, 3):
        raise RuntimeError(f"pip {version} has no --build-constraint: install pip>=25.3")


def build(dist: Path, plugins: Sequence[str] | None = None, *, root: Path = ROOT) -> list[Path]:
    """Build the core's and the ``plugins``' wheels (paths relative to ``root``) into ``dist``;
    returns the wheels' paths, core first."""
    check_pip()
    plugins = default_plugins(root) if plugins is None else list(plugins)
    dist = Path(dist).resolve()
    with tempfile.TemporaryDirectory(prefix="lmserve-wheels-") as tmp:
        source, staging = Path(tmp) / "src", Path(tmp) / "wheels"
        snapshot(root, source)
        projects = [source, *(source / plugin for plugin in plugins)]
        core = pip_wheel(source, staging)
        constraint = Path(tmp) / "build-constraints.txt"
        constraint.write_text(f"lmserve-core @ {core.as_uri()}\n")
        wheels = [core] + [pip_wheel(p, staging, build_constraint=constraint) for p in projects[1:]]
        problems = [
            f"{wheel.name}: {problem}"
            for wheel, project in zip(wheels, projects, strict=True)
            for problem in wheel_problems(wheel, project)
        ]
        if problems:
            raise RuntimeError("bad wheels:\n  " + "\n  ".join(problems))
        dist.mkdir(parents=True, exist_ok=True)
        results = []
        for wheel in wheels:
            name = wheel.name.split("-", 1)[0]
            for old in [*dist.glob(f"{name}-*.whl"), *dist.glob(f"{name}-*.tar.gz")]:
                old.unlink()  # another version of the project would shadow or mix with this one
            results.append(Path(shutil.copy2(wheel, dist / wheel.name)))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plugins", nargs="*", help="plugin directories (default: plugins/*)")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="default: dist/")
    args = parser.parse_args(argv)
    plugins = [(Path.cwd() / p).resolve().relative_to(ROOT).as_posix() for p in args.plugins]
    try:
        wheels = build(args.dist, plugins or None)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"build_wheels: {exc}") from None
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            count = len(zf.namelist())
        print(f"{wheel}  {wheel.stat().st_size / 1024:.0f} KiB, {count} files")


if __name__ == "__main__":
    main()
