"""``bench --plot FILE.png``: draw a benchmark's JSON (benchmarks/gpu.py or benchmarks/cpu.py).

One panel per shape and mode (forward, forward+backward); bars per precision, one colour per
implementation (dcn_cupy and the peers that were installed), time on a log axis. matplotlib is
the optional ``plot`` extra (``pip install "dcn_cupy[plot]"``).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["missing_dependency", "records", "plot_file"]

_MODES = ("forward", "forward+backward")


def missing_dependency():
    """None where matplotlib imports; else the message telling how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ('--plot needs matplotlib, the optional "plot" extra: pip install "dcn_cupy[plot]" '
                '(or pip install matplotlib)')
    return None


def records(report: dict) -> list:
    """``[(shape, precision, mode, implementation, ms)]`` from either benchmark's JSON."""
    rows = []
    if report.get("benchmark") == "cpu":  # benchmarks/cpu.py: one shape, float32, median times
        config = report.get("config", {})
        size = "x".join(str(s) for s in config.get("size", []))
        shape = (f"2D B={config.get('batch')} C{config.get('in_channels')}->{config.get('out_channels')} "
                 f"{size} 3x3 (CPU)")
        for r in report.get("results", []):
            rows.append((shape, config.get("dtype", "float32"), r["mode"], r["library"], float(r["median_ms"])))
        return rows
    for r in report.get("results", []):  # benchmarks/gpu.py: shapes x precisions
        for key, mode in (("fwd_ms", "forward"), ("fwdbwd_ms", "forward+backward")):
            value = r.get(key)
            if isinstance(value, (int, float)):
                rows.append((r["shape"], r["precision"], mode, r["impl"], float(value)))
    return rows


def _title(report: dict) -> str:
    meta = report.get("meta") or report.get("environment") or {}
    device = meta.get("device") or meta.get("cpu") or meta.get("processor") or ""
    return "dcn_cupy benchmark" + (f" on {device}" if device else "")


def plot_file(json_path, png_path) -> None:
    """Read a benchmark JSON and write the figure to ``png_path``."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    import numpy as np

    report = json.loads(Path(json_path).read_text())
    rows = records(report)
    if not rows:
        raise ValueError(f"{json_path} holds no timing rows to plot")
    shapes = list(dict.fromkeys(r[0] for r in rows))
    impls = list(dict.fromkeys(r[3] for r in rows))
    colours = {impl: plt.get_cmap("tab10")(i % 10) for i, impl in enumerate(impls)}

    fig, axes = plt.subplots(len(shapes), len(_MODES), figsize=(6.0 * len(_MODES), 2.6 + 2.4 * len(shapes)),
                             squeeze=False)
    for row, shape in enumerate(shapes):
        precisions = list(dict.fromkeys(r[1] for r in rows if r[0] == shape))
        for col, mode in enumerate(_MODES):
            ax = axes[row][col]
            present = [i for i in impls if any(r[0] == shape and r[2] == mode and r[3] == i for r in rows)]
            width = 0.8 / max(len(present), 1)
            for k, impl in enumerate(present):
                values = [next((r[4] for r in rows if r[:4] == (shape, p, mode, impl)), np.nan) for p in precisions]
                xs = np.arange(len(precisions)) + (k - (len(present) - 1) / 2) * width
                bars = ax.bar(xs, values, width, label=impl, color=colours[impl])
                for bar, value in zip(bars, values):
                    if np.isfinite(value):
                        ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value),
                                    ha="center", va="bottom", fontsize=7)
            ax.set_xticks(np.arange(len(precisions)), precisions)
            ax.set_yscale("log")  # times differ by orders of magnitude across peers and precisions
            shown = [r[4] for r in rows if r[0] == shape and r[2] == mode]
            if shown:  # bars start well below the smallest one, so that their heights compare
                ax.set_ylim(min(shown) / 4, max(shown) * 2)
            ax.set_ylabel("ms (lower is better)")
            ax.set_title(f"{shape}: {mode}", fontsize=10)
            ax.grid(axis="y", alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle(_title(report))
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
