"""Where a benchmark's figures go: printed as they come, and written to a folder
(``--out DIR``, ``bench-results/`` by default) as ``KIND.json`` (the records, with the CPU,
the date and the command), ``KIND.md`` (the printed tables) and ``KIND.png`` (drawn by
``benchmarks/plots.py`` when matplotlib is installed; ``nox -s bench`` and ``nox -s
bench-serve`` install it). ``--json OUT`` writes the records to one more file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("bench-results")


def cpu_model() -> str:
    """The CPU's name with its family / model numbers and the vector extensions the kernels
    use (a virtual machine's name alone, "Intel(R) Xeon(R) Processor", tells little)."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor is enough
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        fields = {}
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
    return (f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
            f"{'; ' + ' '.join(isa) if isa else ''})")


def llama_cpp_version(binary: str | None) -> str | None:
    """What a llama.cpp tool says of its build ("version: 0.5.0-dev (build 1, commit
    0c1e570)"), or None without a binary."""
    if not binary:
        return None
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown build"
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return "unknown build"


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def command_line() -> str:
    """The command that ran this benchmark, its script relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    with_root = script.is_relative_to(ROOT)
    shown = script.relative_to(ROOT).as_posix() if with_root else sys.argv[0]
    return " ".join(["python", shown, *sys.argv[1:]])


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="write the records, tables and plots into this folder "
                             f"(default: {DEFAULT_OUT}/)")
    parser.add_argument("--json", type=Path, help="also write the records to this file")


class Report:
    """A benchmark's printed lines and records, written out by ``finish``."""

    def __init__(self, kind: str, args: argparse.Namespace, threads: int,
                 llama_cpp: str | None = None, name: str | None = None) -> None:
        self.name = name or kind  # of the files written: NAME.json, NAME.md, NAME.png
        self.out: Path | None = args.out
        self.json: Path | None = args.json
        self.lines: list[str] = []
        self.meta: dict[str, Any] = {
            "kind": kind,
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(),
            "threads": threads,
            "command": command_line(),
            "llama.cpp": llama_cpp_version(llama_cpp),
            # the 1-minute load average at the start and the end: other work on the cores
            # (above the thread count) moves every figure, llama.cpp's most
            "load": [load_average()],
        }

    def print(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def finish(self, **records: Any) -> list[Path]:
        """Write the records (and the tables and plots into ``--out``); the paths written."""
        self.meta["load"].append(load_average())
        data = {**self.meta, **records}
        text = json.dumps(data, indent=1) + "\n"
        written = []
        if self.json:
            self.json.write_text(text)
            written.append(self.json)
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            records_path = self.out / f"{self.name}.json"
            records_path.write_text(text)
            tables = self.out / f"{self.name}.md"
            tables.write_text("\n".join([self.meta["command"], "", *self.lines]) + "\n")
            written += [records_path, tables]
            try:
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from plots import plot_record
            except ImportError as exc:  # matplotlib: only the bench sessions install it
                print(f"no plots ({exc}): pip install matplotlib, then "
                      f"python benchmarks/plots.py {records_path}", file=sys.stderr)
            else:
                written += plot_record(data, self.out, self.name)
        if written:
            print("wrote " + ", ".join(os.fspath(p) for p in written), flush=True)
        return written
