"""Figures as pure functions: data in, matplotlib Figure out (no pyplot state, testable headless)."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

IMPL_COLORS = {"kdtree": "#1f77b4", "sglang": "#d62728", "torch": "#7f7f7f"}


def bench_figure(result: dict) -> Figure:
    """Left: time per case for each implementation, with the roofline floor. Right: achieved TFLOP/s
    against the measured matmul ceiling."""
    cases = result["cases"]
    names = [c["name"] for c in cases]
    impls = [i for i in ("kdtree", "sglang", "torch") if any("ms" in c["impls"].get(i, {}) for c in cases)]
    fig = Figure(figsize=(13, 4.8))
    ax, ax2 = fig.subplots(1, 2)
    x = np.arange(len(cases))
    w = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        ms = [c["impls"].get(impl, {}).get("ms", np.nan) for c in cases]
        tf = [c["impls"].get(impl, {}).get("tflops", np.nan) for c in cases]
        ax.bar(x + (k - (len(impls) - 1) / 2) * w, ms, w, label=impl, color=IMPL_COLORS.get(impl))
        ax2.bar(x + (k - (len(impls) - 1) / 2) * w, tf, w, label=impl, color=IMPL_COLORS.get(impl))
    ax.scatter(x, [c["floor_ms"] for c in cases], marker="_", s=400, color="black", zorder=3, label="roofline floor")
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, L2 flushed)")
    ax.set_title("time per verify-attention call")
    ceiling = result["ceilings"]["matmul_bf16_tflops"]
    ax2.axhline(ceiling, color="black", ls="--", lw=1, label=f"bf16 matmul ceiling {ceiling:.0f}")
    ax2.set_ylabel("TFLOP/s (dense count)")
    ax2.set_title("achieved rate")
    for a in (ax, ax2):
        a.set_xticks(x)
        a.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        a.legend(fontsize=8)
    fig.suptitle(f"{result['device']} - {result.get('sglang', '')[:80]}", fontsize=9)
    fig.tight_layout()
    return fig
