"""PNG plots (matplotlib, Agg backend: no display needed): latency CDFs of one run, and goodput / p99 latency
against request rate for a sweep."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from pdserve.bench.metrics import BenchmarkMetrics, SLOs

_SERIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def plot_cdfs(metrics: BenchmarkMetrics, slos: SLOs, path: str | Path, title: str = "") -> Path:
    """One panel per latency metric: the empirical CDF in ms, with the SLO as a dashed line where set."""
    plt = _pyplot()
    rows = metrics.per_request
    values = {"ttft": rows.ttfts_s, "tpot": rows.tpots_s, "itl": rows.itls_s, "e2el": rows.e2els_s}
    limits = {"ttft": slos.ttft_ms, "tpot": slos.tpot_ms, "e2el": slos.e2el_ms}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (key, label) in zip(axes, _SERIES):
        ms = np.sort(np.asarray(values[key], dtype=np.float64) * 1000.0)
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        if limits.get(key):
            ax.axvline(limits[key], linestyle="--", color="red", label=f"SLO {limits[key]:g} ms")
            ax.legend(loc="lower right")
        ax.set(xlabel=f"{label} (ms)", ylabel="fraction of requests" if key != "itl" else "fraction of gaps",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_sweep(rates: list[float], runs: list[BenchmarkMetrics], path: str | Path, title: str = "") -> Path:
    """Goodput (and throughput), p99 TTFT and p99 TPOT against the offered request rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(rates, [m.request_goodput for m in runs], "o-", label="goodput")
    axes[0].plot(rates, [m.request_throughput for m in runs], "s--", label="throughput")
    axes[0].set(xlabel="request rate (req/s)", ylabel="req/s")
    axes[0].legend()
    for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
        ax.plot(rates, [p99_ms(m, key) for m in runs], "o-")
        ax.set(xlabel="request rate (req/s)", ylabel=f"p99 {key.upper()} (ms)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title or "rate sweep")
    fig.tight_layout()
    return _save(fig, plt, path)


def p99_ms(metrics: BenchmarkMetrics, key: str) -> float:
    ms = np.asarray(getattr(metrics.per_request, f"{key}s_s") or [0.0]) * 1000.0
    return float(np.percentile(ms, 99))


def _save(fig: Any, plt: ModuleType, path: str | Path) -> Path:  # fig: a matplotlib Figure
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
