"""benchmarks/plots.py and benchmarks/results.py: recorded benchmark figures
(tests/data/bench/, trimmed from real runs) become PNG plots, so that a broken plotter fails
here rather than at the end of a benchmark run. No benchmark runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from lmserve_core.testing.synthetic import load_script

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
DATA = Path(__file__).resolve().parent / "data" / "bench"
PNG = b"\x89PNG\r\n\x1a\n"


def plots() -> Any:
    return load_script("bench_plots", BENCHMARKS / "plots.py")


def record(kind: str) -> dict[str, Any]:
    return json.loads((DATA / f"{kind}.json").read_text())


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG), path
    assert len(data) > 5_000, f"{path}: {len(data)} bytes, an empty figure?"


@pytest.mark.parametrize("kind", ["decode", "serve", "spec"])
def test_records_become_plots(kind: str, tmp_path: Path) -> None:
    written = plots().plot_record(record(kind), tmp_path, f"bench-{kind}")
    assert written == [tmp_path / f"bench-{kind}.png"]
    assert_png(written[0])


def test_lmserve_alone(tmp_path: Path) -> None:
    """Without llama.cpp's binaries the benchmarks record lmserve alone: still a plot."""
    decode = record("decode")
    for run in decode["runs"]:
        run["llama.cpp"] = None
        run.pop("ratio", None)
    serve = record("serve")
    for entry in serve["records"]:
        entry.pop("llama-server", None)
    for data in (decode, serve):
        data["llama.cpp"] = None
        (path,) = plots().plot_record(data, tmp_path, data["kind"])
        assert_png(path)


def test_records_without_a_kind(tmp_path: Path) -> None:
    """Records written before they named their benchmark are told apart by their shape."""
    for kind in ("decode", "serve", "spec"):
        data = record(kind)
        del data["kind"]
        assert plots().kind_of(data) == kind
    assert plots().plot_record({"runs": []}, tmp_path, "turns") == []


def test_report_writes_records_tables_and_plot(tmp_path: Path) -> None:
    results = load_script("bench_results", BENCHMARKS / "results.py")
    args = argparse.Namespace(out=tmp_path / "out", json=tmp_path / "copy.json")
    report = results.Report("decode", args, threads=2)
    report.print("smollm2 round 1: lmserve pp512 700.0 tg128 300.0")
    sample = record("decode")
    report.finish(**{k: sample[k] for k in ("prompt", "gen", "depth", "reps", "rounds", "runs")})
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["decode.json", "decode.md", "decode.png"]
    written = json.loads((out / "decode.json").read_text())
    assert written == json.loads((tmp_path / "copy.json").read_text())
    assert written["kind"] == "decode" and written["threads"] == 2 and written["cpu"]
    assert written["command"].startswith("python ") and written["date"]
    assert "lmserve pp512 700.0" in (out / "decode.md").read_text()
    assert_png(out / "decode.png")
