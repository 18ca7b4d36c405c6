import json

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kdtree.plots import bench_figure

from conftest import ROOT


def test_bench_figure_from_a_measured_result():
    result = json.loads((ROOT / "docs/bench/v13-h200.json").read_text())
    fig = bench_figure(result)
    assert isinstance(fig, Figure)
    ax, ax2 = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [c["name"] for c in result["cases"]]
    heights = [p.get_height() for p in ax.patches]
    kd = [c["impls"]["kdtree"]["ms"] for c in result["cases"]]
    assert np.allclose(heights[: len(kd)], kd)  # the first bar series is the kernel's time
    assert ax.get_yscale() == "log"
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    img = np.asarray(canvas.buffer_rgba())
    blue = (np.abs(img[..., 0].astype(int) - 0x1F) < 8) & (np.abs(img[..., 2].astype(int) - 0xB4) < 8)
    assert blue.sum() > 1000  # the kernel's bars are drawn


def test_sglang_bench_figure_from_a_measured_result():
    from kdtree.plots import sglang_bench_figure

    result = json.loads((ROOT / "docs/bench/sglang-serving-h200.json").read_text())
    fig = sglang_bench_figure(result)
    left, right = fig.axes
    assert len(left.patches) == 4 * len(result["cases"]) and len(right.patches) == 2 * len(result["cases"])
    heights = sorted(round(p.get_height(), 6) for p in right.patches)
    assert heights == sorted(round(c["speedup"][m], 6) for c in result["cases"] for m in ("eager", "graph"))
