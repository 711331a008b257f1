"""Plots of the benchmarks' records: the JSON files that ``bench_decode.py``,
``bench_serve.py`` and ``bench_serve.py --spec`` write into their ``--out`` folder
(``bench-results/`` by default), which draw these plots themselves when matplotlib is
installed. This script draws them again from the records:

    python benchmarks/plots.py bench-results/decode.json [bench-results/serve.json ...]
        [--out DIR] [--prefix NAME-] [--dpi 100]

- ``decode.json``: prefill and decode tok/s per model, lmserve against llama.cpp's
  llama-bench (the median over the rounds; the whiskers span the rounds);
- ``serve.json``: aggregate completion tok/s and time to first token (p50, p95) against the
  number of concurrent chats, lmserve against llama-server, and what 3 streams and a long
  prompt arriving among them wait for;
- ``spec.json``: single-stream decode tok/s per workload, plain against ``--spec``.

Each plot is ``DIR/PREFIX + the record's name + .png`` (by default next to its record) and
names the CPU, the thread count, the date and the command of its run in a footnote.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from PIL import Image  # noqa: E402  (a dependency of matplotlib's)

COLORS = {
    "lmserve": "#1f77b4", "llama.cpp": "#ff7f0e", "llama-server": "#ff7f0e",
    "plain": "#8c8c8c", "--spec": "#1f77b4", "--spec-draft": "#2ca02c",
}
MODELS = {
    "smollm2": "SmolLM2-135M Q4_1",
    "gemma3-270m": "Gemma-3-270M Q4_K_M",
    "qwen3-0.6b": "Qwen3-0.6B geometry Q8_0",
    "qwen3moe-1b": "Qwen3-MoE 1.2B Q8_0",
    "qwen35-0.8b": "Qwen3.5-0.8B geometry Q8_0",
}
FOOT_LINE = 0.15  # inches a footnote line takes


def model_label(name: str) -> str:
    return MODELS.get(name, Path(name).name)


def median_range(values: list[float]) -> tuple[float, float, float]:
    """(median, median - min, max - median): a bar and its whiskers."""
    if not values:
        return math.nan, 0.0, 0.0
    mid = statistics.median(values)
    return mid, mid - min(values), max(values) - mid


def footnote_lines(data: dict[str, Any], engine: str | None) -> list[str]:
    head = (f"{data.get('cpu', 'CPU not recorded')}, {data.get('threads', '?')} threads, "
            f"{data.get('date', 'date not recorded')}")
    load = [f"{x:.1f}" for x in data.get("load") or [] if x is not None]
    if load:
        head += f", load average {' -> '.join(load)}"
    if engine:
        version = data.get("llama.cpp")
        head += f"; {engine} {version}" if version else f"; {engine} not measured"
    command = data.get("command")
    return [head, *([command] if command else [])]


def figure(rows: int, cols: int, size: tuple[float, float], title: str, foot: list[str]
           ) -> tuple[Figure, Any, list[str]]:
    """A figure of rows x cols axes with a title and a footnote (wrapped to its width)."""
    width, height = size
    chars = int(width * 72 / (7 * 0.62))  # 7-point monospace characters in the width
    foot = [part for line in foot for part in textwrap.wrap(line, chars, break_on_hyphens=False)]
    fig, axes = plt.subplots(rows, cols, figsize=(width, height + FOOT_LINE * len(foot)),
                             squeeze=False)
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, "\n".join(foot), fontsize=7, color="0.35", ha="left", va="bottom",
             family="monospace")
    return fig, axes, foot


def finish(fig: Figure, foot: list[str]) -> None:
    bottom = (FOOT_LINE * len(foot) + 0.1) / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))


def grouped_bars(ax: Axes, groups: list[str], series: dict[str, list[list[float]]],
                 fmt: Callable[[float], str]) -> None:
    """Bars per group and series at the median of their values, whiskers over the range."""
    width = 0.8 / max(1, len(series))
    for i, (name, per_group) in enumerate(series.items()):
        stats = [median_range(v) for v in per_group]
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        spans = any(lo or hi for _, lo, hi in stats)
        bars = ax.bar(xs, [s[0] for s in stats], width, label=name,
                      color=COLORS.get(name), alpha=0.9,
                      yerr=[[s[1] for s in stats], [s[2] for s in stats]] if spans else None,
                      capsize=2, error_kw={"elinewidth": 0.8, "ecolor": "0.3"})
        for bar, (mid, _, hi) in zip(bars, stats, strict=True):
            if not math.isnan(mid):  # above the whisker
                ax.annotate(fmt(mid), (bar.get_x() + bar.get_width() / 2, mid + hi),
                            textcoords="offset points", xytext=(0, 2), ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.margins(y=0.3)  # room for the labels and a legend of one row
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def ordered(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def plot_decode(data: dict[str, Any]) -> Figure:
    runs = data["runs"]
    models = ordered(r["model"] for r in runs)
    keys = [k for k in ("pp", "tg") if any(k in r["lmserve"] for r in runs)]
    engines = ["lmserve"] + (["llama.cpp"] if any(r.get("llama.cpp") for r in runs) else [])
    depth = data.get("depth") or 0
    tests = {"pp": f"prefill, pp{data.get('prompt', 512)}",
             "tg": f"decode, tg{data.get('gen', 128)}" + (f" after {depth} tokens" if depth else "")}
    title = ("lmserve against llama.cpp (llama-bench): tok/s, higher is better"
             if len(engines) == 2 else "lmserve: tok/s (llama.cpp not measured)")
    foot = footnote_lines(data, "llama.cpp")
    fig, axes, foot = figure(1, len(keys), (1.2 + 2.4 * len(models) * len(keys), 3.8), title, foot)
    rounds = max(sum(1 for r in runs if r["model"] == m) for m in models)
    for ax, key in zip(axes[0], keys, strict=False):
        series = {e: [[r[e][key] for r in runs if r["model"] == m and r.get(e)] for m in models]
                  for e in engines}
        groups = []
        for m in models:
            ratios = [r["ratio"][key] for r in runs if r["model"] == m and r.get("ratio")]
            groups.append(model_label(m).replace(" ", "\n", 1) + (
                f"\n{statistics.median(ratios):.2f}x llama.cpp" if ratios else ""))
        grouped_bars(ax, groups, series, lambda v: f"{v:.0f}" if v >= 10 else f"{v:.1f}")
        ax.set_title(tests[key] + (f", median of {rounds} rounds" if rounds > 1 else ""),
                     fontsize=10)
        ax.set_ylabel("tok/s")
        ax.legend(fontsize=8, loc="upper right", ncols=len(engines))
    finish(fig, foot)
    return fig


def plot_serve(data: dict[str, Any]) -> Figure:
    records = data["records"]
    models = ordered(r["model"] for r in records)
    engines = [e for e in ("lmserve", "llama-server") if any(e in r for r in records)]
    concurrency = data.get("concurrency") or sorted(
        {int(k.removeprefix("chat x")) for r in records for k in r["lmserve"]
         if k.startswith("chat x")})
    title = ("Many users at once: lmserve against llama-server"
             if len(engines) == 2 else "Many users at once: lmserve (llama-server not measured)")
    foot = footnote_lines(data, "llama-server")
    fig, axes, foot = figure(len(models), 3, (13, 3.2 * len(models)), title, foot)
    for row, model in zip(axes, models, strict=False):
        mine = [r for r in records if r["model"] == model]

        def figures(engine: str, workload: str, field: str, mine: list = mine) -> list[float]:
            return [r[engine][workload][field] for r in mine
                    if engine in r and workload in r[engine]]

        through, ttft, long = row
        for engine in engines:
            rate = [statistics.median(figures(engine, f"chat x{n}", "tok_s")) for n in concurrency]
            through.plot(concurrency, rate, marker="o", color=COLORS[engine], label=engine)
            if engine == "lmserve" and len(engines) == 2:
                theirs = [statistics.median(figures(engines[1], f"chat x{n}", "tok_s"))
                          for n in concurrency]
                for n, ours, other in zip(concurrency, rate, theirs, strict=True):
                    through.annotate(f"{ours / other:.1f}x", (n, ours), fontsize=7,
                                     textcoords="offset points", xytext=(0, 5), ha="center")
            for field, style in (("ttft_p50", "-"), ("ttft_p95", "--")):
                ttft.plot(concurrency,
                          [statistics.median(figures(engine, f"chat x{n}", field))
                           for n in concurrency],
                          style, marker="o", color=COLORS[engine],
                          label=f"{engine} {field.removeprefix('ttft_')}")
        through.set_title(f"{model_label(model)}: aggregate completion tok/s", fontsize=9)
        through.set_ylim(0, 1.2 * max(line.get_ydata().max() for line in through.lines))
        ttft.set_title("time to first token (s), p50 and p95", fontsize=9)
        ttft.set_yscale("log")
        for ax in (through, ttft):
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrency, [str(n) for n in concurrency])
            ax.minorticks_off()
            ax.set_xlabel("concurrent streaming chats", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        grouped_bars(
            long, ["longest pause of\n3 streams", "the long prompt's\nfirst token"],
            {e: [figures(e, "long prompt", "max_gap"), figures(e, "long prompt", "long_ttft")]
             for e in engines},
            lambda v: f"{v:.2f} s" if v < 1 else f"{v:.1f} s")
        long.set_title("a ~3.2k-token prompt arrives mid-stream (s)", fontsize=9)
    finish(fig, foot)
    return fig


def plot_spec(data: dict[str, Any]) -> Figure:
    models = data["models"]
    title = "Speculative decoding (prompt lookup): one greedy stream, decode tok/s"
    foot = footnote_lines(data, None)
    fig, axes, foot = figure(1, len(models), (1 + 5.2 * len(models), 3.8), title, foot)
    for ax, entry in zip(axes[0], models, strict=False):
        workloads = entry["workloads"]
        variants = ordered(v for w in workloads.values() for v in w["variants"])
        groups = []
        for name, w in workloads.items():
            ratios = "\n".join(f"{v} {w['variants'][v]['ratio']:.2f}x" for v in variants[1:])
            groups.append(f"{name}\n{ratios}" + ("" if w["identical"] else "\nreplies differ"))
        series = {v: [w["variants"][v].get("rounds") or [w["variants"][v]["tok_s"]]
                      for w in workloads.values()] for v in variants}
        grouped_bars(ax, groups, series, lambda v: f"{v:.0f}")
        rounds = data.get("rounds")
        ax.set_title(f"{model_label(entry['model'])}"
                     + (f", median of {rounds} rounds" if (rounds or 0) > 1 else ""), fontsize=10)
        ax.set_ylabel("tok/s")
        ax.legend(fontsize=8, loc="upper right", ncols=len(variants))
    finish(fig, foot)
    return fig


PLOTS: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "decode": plot_decode, "serve": plot_serve, "spec": plot_spec,
}


def kind_of(data: dict[str, Any]) -> str | None:
    """The benchmark a record comes from (records written before they named it: by shape)."""
    if "kind" in data:
        return str(data["kind"])
    if "records" in data:
        return "serve"
    if "models" in data:
        return "spec"
    if data.get("runs") and "lmserve" in data["runs"][0]:
        return "decode"
    return None


def plot_record(data: dict[str, Any], out: Path, name: str, dpi: int = 100) -> list[Path]:
    """Draw a benchmark's records into ``out/name.png``; the paths written (none for a
    benchmark without a plot)."""
    draw = PLOTS.get(kind_of(data) or "")
    if draw is None:
        return []
    with plt.rc_context({"figure.dpi": dpi}):
        fig = draw(data)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.canvas.draw()
    image = Image.frombuffer("RGBA", fig.canvas.get_width_height(physical=True),
                             fig.canvas.buffer_rgba())
    plt.close(fig)
    # a palette of 256 colours keeps a plot of lines and bars sharp at a third of the bytes
    image.convert("RGB").quantize(256).save(path, optimize=True, dpi=(dpi, dpi))
    return [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="JSON records of a benchmark")
    parser.add_argument("--out", type=Path, help="folder of the plots (default: the records')")
    parser.add_argument("--prefix", default="", help="put before each plot's name")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args()
    for path in args.records:
        data = json.loads(path.read_text())
        written = plot_record(data, args.out or path.parent, args.prefix + path.stem, args.dpi)
        print(", ".join(str(p) for p in written) if written else f"{path}: nothing to plot")


if __name__ == "__main__":
    main()
