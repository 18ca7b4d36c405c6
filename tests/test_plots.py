import json

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kdtree.plots import bench_figure

from conftest import ROOT


def test_bench_figure_from_a_measured_result():
    result = json.loads((ROOT / "tests/fixtures/bench-h200.json").read_text())
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


def test_bench_figure_draws_flashinfer_where_it_ran():
    """The chain bench's figure (kdtree bench --chain) has FlashInfer's bars beside kdtree's, in the run's order."""
    result = json.loads((ROOT / "tests/fixtures/bench-chain-h200.json").read_text())
    ax, _ = bench_figure(result).axes
    assert [t.get_text() for t in ax.get_legend().get_texts()][-3:] == ["kdtree", "flashinfer", "torch"]
    n = len(result["cases"])
    heights = [p.get_height() for p in ax.patches]
    assert np.allclose(heights[n : 2 * n], [c["impls"]["flashinfer"]["ms"] for c in result["cases"]])


def test_sglang_bench_figure_from_a_measured_result():
    from kdtree.plots import sglang_bench_figure

    result = json.loads((ROOT / "tests/fixtures/sglang-serving-h200.json").read_text())
    fig = sglang_bench_figure(result)
    left, right, host = fig.axes
    assert len(left.patches) == 4 * len(result["cases"]) and len(right.patches) == 2 * len(result["cases"])
    assert len(host.patches) == 4 * len(result["cases"])
    heights = sorted(round(p.get_height(), 6) for p in right.patches)
    assert heights == sorted(round(c["speedup"][m], 6) for c in result["cases"] for m in ("eager", "graph"))


def test_bench_summary_reports_fractions_of_every_ceiling_and_the_geomean():
    from kdtree.bench import BENCH_CASES, ceiling_fractions, gather_fraction, gathered_bytes, geomean, summary_table

    assert geomean([2.0, 8.0, None]) == pytest.approx(4.0) and geomean([None]) is None
    ceilings = {"matmul_bf16_tflops": 800.0, "copy_tbps": 4.0, "mma_sync_raw_tflops": 600.0, "mma_sync_ldmatrix_tflops": 400.0}
    assert ceiling_fractions(200.0, ceilings) == {"matmul_bf16": 0.25, "mma_sync_raw": 200 / 600, "mma_sync_ldmatrix": 0.5}
    assert ceiling_fractions(200.0, {"matmul_bf16_tflops": 800.0}) == {"matmul_bf16": 0.25}
    result = json.loads((ROOT / "tests/fixtures/bench-h200.json").read_text())
    result["geomean_speedup_vs_sglang"] = geomean([c["impls"]["kdtree"]["speedup_vs_sglang"] for c in result["cases"]])
    speedups = np.array([c["impls"]["kdtree"]["speedup_vs_sglang"] for c in result["cases"]])
    want = float(np.exp(np.log(speedups).mean()))  # 13.98 on the H200's run of all 12 cases
    table = summary_table(result).splitlines()
    assert table[-1] == f"geomean speedup over SGLang on {len(speedups)} cases: {want:.2f}x"
    # each case's fractions of the matmul and both mma.sync ceilings, from its own rate and the measured ceilings,
    # and its gather rate (the plan's units x 32 rows x 1,152 B a second) against the L2 gather ceiling
    ceil = result["ceilings"]
    cols = next(i for i, line in enumerate(table) if line.startswith("case"))  # the header lines come first
    header = "\n".join(table[:cols])
    assert "mma.sync" in header and f"gather: L2 {ceil['gather_l2_tbps']:.2f} TB/s" in header
    assert table[cols].split()[-6:] == ["%matmul", "%mma", "%ldsm", "gath", "TB/s", "%gath"]
    for c, line in zip(result["cases"], table[cols + 1 :]):
        k = c["impls"]["kdtree"]
        fr = ceiling_fractions(k["tflops"], ceil)
        gath = gathered_bytes(k["units"], 32) / k["ms"] / 1e9
        assert k["stages"] == 4 and gath == pytest.approx(k["gather_tbps"])  # (the Hopper body's 4-stage ring)
        assert line.split()[-5:] == [f"{100 * fr[key]:.0f}%" for key in ("matmul_bf16", "mma_sync_raw", "mma_sync_ldmatrix")] + [
            f"{gath:.2f}",
            f"{100 * gath / ceil['gather_l2_tbps']:.0f}%",
        ]
    sm120 = json.loads((ROOT / "tests/fixtures/bench-sm120-config-h200.json").read_text())
    for c in sm120["cases"]:  # the sm_120 configuration's 2-stage ring is held against the 2-stage ceiling
        k = c["impls"]["kdtree"]
        assert k["stages"] == 2 and k["fraction_of"]["gather_l2"] == pytest.approx(
            k["gather_tbps"] / sm120["ceilings"]["gather_l2_2stages_tbps"]
        )
    assert gather_fraction(1.0, 4, {"gather_l2_2stages_tbps": 4.0}) == {}
    for key in ("mma_sync_raw_tflops", "gather_l2_tbps"):  # a run without those ceilings has no such columns
        del ceil[key]
    assert "%mma" not in summary_table(result) and "%gath" not in summary_table(result)
    # the four shapes beside the eight; N 1 is a one-token chain, not a DDTree of budget 0
    names = [c.name for c in BENCH_CASES]
    assert len(names) == len(set(names)) == 12
    n1 = next(c for c in BENCH_CASES if c.num_draft == 1).spec().resolved()
    assert n1.tree == "chain" and n1.num_draft_tokens == 1 and n1.batch_size == 64


# ----- mask figures say the layout as it is ----------------------------------------------------------------
def _mask_capture():
    from kdtree.capture import load

    return load(ROOT / "data/captured_batches/mixed-prefix.safetensors")


def test_the_draft_block_is_labelled_with_the_requests_real_prefix_and_stride():
    from kdtree import plots

    cap = _mask_capture()
    b = 3
    p, n = int(cap.prefix_lens[b]), int(cap.num_draft[b])
    assert p > 0
    fig = plots.mask_figure(cap.tree_block(b).numpy(), p, first_col=p, selected=2)
    ax = fig.axes[0]
    assert f"prefix_len + N = {p} + {n} = {p + n}" in ax.get_xlabel()
    lo, hi = ax.get_xlim()
    assert (lo, hi) == (p - 0.5, p + n - 0.5)  # the draft columns where they are in the row
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"draft columns from prefix_len = {p}; " in ax.get_xlabel() and "node 2" in labels
    assert "mixed block" not in labels  # one pixel a cell: no block is mixed, so the legend lists none
    whole = plots.mask_figure(cap.mask_rows(b).numpy(), p, zoom=(0, n, p - 8, p + n))  # the prefix's end too
    assert f"draft columns start at prefix_len = {p}" in [t.get_text() for t in whole.axes[0].get_legend().get_texts()]
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1  # outside the data
    wrong = plots.mask_figure(cap.tree_block(b).numpy(), p, first_col=p, stride=p)
    assert f"rows read at stride {p}, not prefix_len + N = {p} + {n} = {p + n}" in wrong.axes[0].get_xlabel()


def test_the_fault_figure_marks_exactly_the_flipped_cells():
    from kdtree import plots
    from kdtree.marshal import marshal

    cap = _mask_capture()
    b = 3
    good, bad = marshal(cap).steps[b], marshal(cap, "prefix-stride").steps[b]
    flipped = int((good.tree_block != bad.tree_block).sum())
    fig = plots.mask_fault_figure(good.tree_block.numpy(), bad.tree_block.numpy(), good.prefix_len, bad.mask_row_stride)
    left, right = fig.axes[:2]
    assert left.get_title().endswith(f"= {good.prefix_len} + {good.num_draft} = {good.mask_row_stride}")
    assert f"stride {bad.mask_row_stride}; {flipped} of" in right.get_title() and flipped > 0
    shown = np.asarray(right.images[0].get_array())
    leaked = (bad.tree_block & ~good.tree_block).numpy()
    assert ((shown == plots.LEAKED) == leaked).all() and (
        (shown == plots.LOST) == (good.tree_block & ~bad.tree_block).numpy()
    ).all()
    labels = [t.get_text() for t in right.get_legend().get_texts()]  # a kind of flip is listed where there is one
    assert ("flipped: visible, must be hidden" in labels) == leaked.any() and ("flipped: hidden, must be visible" in labels) == (
        shown == plots.LOST
    ).any()
    assert (shown >= plots.LEAKED).sum() == flipped and np.isin(
        np.asarray(left.images[0].get_array()), (plots.ALL, plots.NONE)
    ).all()


def test_tree_depth_ticks_are_whole_numbers():
    from kdtree import plots

    fig = plots.tree_figure(np.array([-1, 0, 0, 1]))
    fig.canvas = FigureCanvasAgg(fig)
    fig.canvas.draw()
    ticks = [t for t in fig.axes[0].get_yticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_the_explorer_says_when_a_smaller_tree_moves_the_node():
    pytest.importorskip("ipywidgets")
    from kdtree.widgets import DDTreeExplorer

    paths = [ROOT / "data/captured_batches" / n for n in ("ddtree64-bs3.safetensors", "kimi-dp-h64.safetensors")]
    ex = DDTreeExplorer(paths)
    ex.node.value = 60
    assert ex.state.node == 60 and ex.state.note == ""
    renders = ex.state.renders
    ex.zoom.value = 4.0  # the draft-block view zooms too: a new render
    assert ex.state.renders == renders + 1 and ex.state.view == "draft block"
    ex.capture.value = "kimi-dp-h64.safetensors"  # N = 13
    assert ex.state.node == 12 and "node 60 is past this request's N = 13" in ex.state.note


def test_the_pool_map_names_every_colour_and_no_two_requests_share_one():
    from kdtree import plots

    pairs = plots.request_colors(16)
    assert len({c for pair in pairs for c in pair}) == 32  # 16 requests, prefix and draft each their own
    codes = plots.pool_codes(2528, [np.array([1 + b]) for b in range(16)], [np.array([100 + b]) for b in range(16)])
    fig = plots.pool_figure(codes, 16, width=64)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"free", "slot 0 (padding)", "past the pool's end", "req 15 prefix", "req 15 draft"} <= set(labels)
    assert "slots 0..2,527 (slot 0 is padding, 2,527 allocatable)" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["+0", "+16"]


def test_the_row_and_error_figures_label_their_scales():
    from kdtree import plots

    rows = np.random.default_rng(0).normal(size=(2, 576))
    fig = plots.kv_row_figure(rows, [7, 9], labels=["req 0 prefix", "req 0 draft"])
    assert "[slots, 1, 576] bf16, 1,152 B a row" in fig.axes[0].get_title()
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["slot 7 (req 0 prefix)", "slot 9 (req 0 draft)"]
    assert fig.axes[1].get_ylabel() == "value"
    err = plots.error_map_figure(np.full((6, 4), 1e-3), np.array([0, 1, 1, 0, 1, 2]), request_starts=[0, 3])
    labels = {a.get_ylabel() for a in err.axes}
    assert {"log10(rel error)", "depth in the tree"} <= labels
    assert [t.get_text().strip() for t in err.axes[0].texts] == ["req 0", "req 1"]


def test_the_key_reads_figure_counts_the_draft_keys_prefix_only_kv_misses():
    from kdtree import plots
    from kdtree.marshal import marshal

    cap = _mask_capture()
    b = 3
    good, only = marshal(cap).steps[b], marshal(cap, "prefix-only-kv").steps[b]
    fig = plots.key_reads_figure(good.prefix_slots.numpy(), good.draft_slots.numpy(), only.combined_slots.numpy())
    assert fig.axes[0].get_title() == f"{good.num_draft} of {good.prefix_len + good.num_draft} keys never read"
    ok = plots.key_reads_figure(good.prefix_slots.numpy(), good.draft_slots.numpy(), good.combined_slots.numpy())
    assert ok.axes[0].get_title().startswith("0 of")


def test_the_capture_picker_takes_a_shipped_file_or_any_path_or_directory(tmp_path):
    pytest.importorskip("ipywidgets")
    from kdtree.widgets import CapturePicker

    shipped = sorted((ROOT / "data/captured_batches").glob("*.safetensors"))
    picker = CapturePicker("mixed-prefix.safetensors")
    assert picker.paths == [ROOT / "data/captured_batches/mixed-prefix.safetensors"]
    assert picker.load().batch_size == 5
    picker.path.value = str(ROOT / "data/captured_batches")  # a directory: every capture in it
    assert picker.paths == shipped
    picker.path.value = str(tmp_path)
    with pytest.raises(ValueError, match="no capture files"):
        picker.load()
    picker.path.value = str(tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="no such file"):
        picker.load()


def test_the_requests_figure_shows_every_requests_keys():
    from kdtree import plots
    from kdtree.info import summarize

    s = summarize(_mask_capture())
    fig = plots.requests_figure(s)
    texts = [t.get_text().strip() for t in fig.axes[0].texts]
    assert texts == [f"{r['prefix_len']:,} + {r['num_draft']}" for r in s["requests"]]
    pool = s["pool"]
    assert f"{pool['referenced_slots']:,} of {pool['pool_size']:,} slots referenced" in fig._suptitle.get_text()


def test_the_explorer_takes_captures_of_yours(tmp_path):
    pytest.importorskip("ipywidgets")
    import shutil

    from kdtree.widgets import DDTreeExplorer

    shipped = ROOT / "data/captured_batches"
    ex = DDTreeExplorer([shipped / "ddtree256.safetensors"])
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(shipped / "kimi-dp-h64.safetensors", mine / "kimi-dp-h64.safetensors")
    assert ex.add_captures(str(mine)) == ["kimi-dp-h64.safetensors"]
    assert ex.state.capture == "kimi-dp-h64.safetensors" and "added 1" in ex.message.value
    assert ex.add_captures(str(tmp_path / "nothing")) == [] and "no such file" in ex.message.value


def test_the_report_figure_puts_the_tuners_picks_under_the_bench():
    from kdtree.plots import report_figure

    bench = json.loads((ROOT / "tests/fixtures/bench-h200.json").read_text())
    tune = json.loads((ROOT / "tests/fixtures/tune-h100.json").read_text())  # `kdtree tune`'s result on an H100
    rows = tune["summary"]["rows"]
    ax, ax2, ax3 = report_figure(bench, tune, "t", margin=0.03).axes
    assert ax2.get_ylim()[1] > bench["ceilings"]["matmul_bf16_tflops"]  # the ceiling line in view, below the legend
    assert [t.get_text() for t in ax3.get_xticklabels()] == [r["batch"] for r in rows]
    n = len(rows)
    heights = [p.get_height() for p in ax3.patches]
    assert np.allclose(heights[n : 2 * n], [100 * (r["tuned_ratio"] - 1) for r in rows])
    legend = [t.get_text() for t in ax3.get_legend().get_texts()]
    for key, label in (("shipped", "shipped constants"), ("tuned", "tuned")):  # the tuner's own counts
        assert f"{label}: {tune['summary']['within_margin'][key]} of {n} within 3 %" in legend
    assert len(report_figure(None, tune, "t", margin=0.03).axes) == 1  # the bench failed: the tuner's panel alone
    with pytest.raises(ValueError, match="neither"):
        report_figure(None, {"summary": {"rows": []}}, "t", margin=0.03)
