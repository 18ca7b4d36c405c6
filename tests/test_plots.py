import json

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kdtree.plots import bench_figure

from conftest import ROOT


def test_bench_figure_from_a_measured_result():
    result = json.loads((ROOT / "docs/bench/bench-h200.json").read_text())
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
    left, right, host = fig.axes
    assert len(left.patches) == 4 * len(result["cases"]) and len(right.patches) == 2 * len(result["cases"])
    assert len(host.patches) == 4 * len(result["cases"])
    heights = sorted(round(p.get_height(), 6) for p in right.patches)
    assert heights == sorted(round(c["speedup"][m], 6) for c in result["cases"] for m in ("eager", "graph"))


def test_bench_summary_reports_fractions_of_every_ceiling_and_the_geomean():
    from kdtree.bench import ALL_CASES, ceiling_fractions, gather_fraction, gathered_bytes, geomean, summary_table

    assert geomean([2.0, 8.0, None]) == pytest.approx(4.0) and geomean([None]) is None
    ceilings = {"matmul_bf16_tflops": 800.0, "copy_tbps": 4.0, "mma_sync_raw_tflops": 600.0, "mma_sync_ldmatrix_tflops": 400.0}
    assert ceiling_fractions(200.0, ceilings) == {"matmul_bf16": 0.25, "mma_sync_raw": 200 / 600, "mma_sync_ldmatrix": 0.5}
    assert ceiling_fractions(200.0, {"matmul_bf16_tflops": 800.0}) == {"matmul_bf16": 0.25}
    result = json.loads((ROOT / "docs/bench/bench-h200.json").read_text())
    result["geomean_speedup_vs_sglang"] = geomean([c["impls"]["kdtree"]["speedup_vs_sglang"] for c in result["cases"]])
    speedups = np.array([c["impls"]["kdtree"]["speedup_vs_sglang"] for c in result["cases"]])
    want = float(np.exp(np.log(speedups).mean()))  # 13.96 on the H200's run of all 12 cases
    table = summary_table(result).splitlines()
    assert table[-1] == f"geomean speedup over SGLang on {len(speedups)} cases: {want:.2f}x"
    # each case's fractions of the matmul and both mma.sync ceilings, from its own rate and the measured ceilings
    assert "mma.sync" in table[0] and table[1].split()[-3:] == ["%matmul", "%mma", "%ldsm"]
    for c, line in zip(result["cases"], table[2:]):
        fr = ceiling_fractions(c["impls"]["kdtree"]["tflops"], result["ceilings"])
        assert line.split()[-3:] == [f"{100 * fr[k]:.0f}%" for k in ("matmul_bf16", "mma_sync_raw", "mma_sync_ldmatrix")]
    del result["ceilings"]["mma_sync_raw_tflops"]  # a run without the mma.sync ceilings has no such columns
    assert "%mma" not in summary_table(result) and "%gath" not in summary_table(result)
    # the gather rate against the L2 gather ceiling of the launch's stage count
    result["ceilings"] |= {"gather_l2_tbps": 5.0, "gather_l2_2stages_tbps": 4.0, "gather_hbm_tbps": 3.0}
    for c, stages in zip(result["cases"], (4, 2) * 6):
        k = c["impls"]["kdtree"]
        k["gather_tbps"] = gathered_bytes(k["units"], 32) / k["ms"] / 1e9
        k["fraction_of"] = gather_fraction(k["gather_tbps"], stages, result["ceilings"])
    table = summary_table(result).splitlines()
    assert "gather L2 5.00 TB/s (4.00 with 2 stages), HBM 3.00" in table[0] and table[1].split()[-2:] == ["TB/s", "%gath"]
    for i, (c, line) in enumerate(zip(result["cases"], table[2:])):
        k = c["impls"]["kdtree"]
        want = k["units"] * 32 * 1152 / k["ms"] / 1e9
        assert line.split()[-2:] == [f"{want:.2f}", f"{100 * want / (5.0 if i % 2 == 0 else 4.0):.0f}%"]
    assert gather_fraction(1.0, 4, {"gather_l2_2stages_tbps": 4.0}) == {}
    # the four shapes beside the eight; N 1 is a one-token chain, not a DDTree of budget 0
    names = [c.name for c in ALL_CASES]
    assert len(names) == len(set(names)) == 12
    n1 = next(c for c in ALL_CASES if c.num_draft == 1).spec().resolved()
    assert n1.tree == "chain" and n1.num_draft_tokens == 1 and n1.batch_size == 64
