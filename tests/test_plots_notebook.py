"""The notebooks' figures: pure functions, fast on the largest inputs, and they show what they claim."""

import io
import time

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from kdtree import plots
from kdtree.capture import load
from kdtree.trees import ancestor_mask, ddtree, draft_logprobs, random_tree

from conftest import SHIPPED


def png_bytes(fig) -> int:
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.tell()


def test_downsampling_keeps_an_isolated_cell():
    mask = np.ones((1025, 131072 + 1025), dtype=bool)
    mask[700, 90_001] = False  # one hidden cell in 134 million
    blocks, fr, fc = plots.mask_blocks(mask)
    assert blocks.shape[0] <= 1024 and blocks.shape[1] <= 1024
    assert (blocks == plots.MIXED).sum() == 1
    assert blocks[700 // fr, 90_001 // fc] == plots.MIXED
    assert (blocks == plots.ALL).sum() == blocks.size - 1


def test_full_mask_of_1025_by_131k_renders_fast_and_small():
    rows = np.ones((1025, 131072 + 1025), dtype=bool)
    rows[:, 131072:] = ancestor_mask(random_tree(1025, np.random.default_rng(0)))
    t0 = time.perf_counter()
    fig = plots.mask_figure(rows, 131072, selected=5)
    size = png_bytes(fig)
    assert time.perf_counter() - t0 < 10.0  # a generous bound (under 1 s on a developer CPU): what matters is the size
    assert size < 3e6


def test_million_slot_pool_renders_fast():
    rng = np.random.default_rng(0)
    slots = rng.permutation(np.arange(1, 1_000_001))
    prefix = [slots[:300_000], slots[300_000:310_000]]
    draft = [slots[310_000:310_065], slots[310_065:310_130]]
    t0 = time.perf_counter()
    codes = plots.pool_codes(1_000_001, prefix, draft)
    fig = plots.pool_figure(codes, 2)
    size = png_bytes(fig)
    assert time.perf_counter() - t0 < 10.0 and size < 3e6  # generous: the figure is drawn from a downsampled image
    img, per_cell = plots.pool_map_image(codes)
    # draft slots win their cells: every draft slot's cell shows a draft code
    for d in draft:
        cells = np.unique(np.asarray(d) // per_cell)
        assert np.all(img.reshape(-1)[cells] % 2 == 1) and np.all(img.reshape(-1)[cells] >= 3)
    assert codes[0] == plots.PADDING and per_cell > 1
    small, one = plots.pool_map_image(plots.pool_codes(100, [np.array([5, 6])], [np.array([9])]))
    assert one == 1 and small.reshape(-1)[[0, 5, 9, 10]].tolist() == [plots.PADDING, 2, 3, plots.FREE]


def test_tree_layout_puts_children_below_and_leaves_apart():
    p = ddtree(40, draft_logprobs(6, 4, np.random.default_rng(1)))
    x, y = plots.tree_layout(p)
    assert np.all(y[1:] == y[p[1:]] + 1)
    leaves = [i for i in range(len(p)) if i not in set(p[1:].tolist())]
    assert len(set(x[leaves].tolist())) == len(leaves)  # each leaf has its own column
    assert plots.path_to_root(p, int(leaves[-1]))[-1] == 0


def test_selected_node_is_highlighted():
    p = random_tree(30, np.random.default_rng(2))
    fig0, fig1 = plots.tree_figure(p), plots.tree_figure(p, selected=29)
    c0, c1 = FigureCanvasAgg(fig0), FigureCanvasAgg(fig1)
    c0.draw(), c1.draw()
    img0, img1 = np.asarray(c0.buffer_rgba()), np.asarray(c1.buffer_rgba())
    red = lambda im: ((im[..., 0] > 200) & (im[..., 1] < 90) & (im[..., 2] < 90)).sum()  # noqa: E731
    assert red(img0) == 0 and red(img1) > 50


def test_capture_figures_render():
    cap = load(next(p for p in SHIPPED if "mixed" in p.name))
    b = 3
    fig = plots.mask_figure(cap.mask_rows(b).numpy(), int(cap.prefix_lens[b]))
    assert png_bytes(fig) > 0
    rows = cap.layer(0).kv_buffer_rows[:4, 0].float().numpy()
    assert png_bytes(plots.kv_row_figure(rows, cap.kv_buffer_slots[:4].tolist())) > 0
    err = np.abs(np.random.default_rng(0).normal(size=(cap.num_tokens, 8))) * 1e-3
    assert png_bytes(plots.error_map_figure(err, np.arange(cap.num_tokens) % 5)) > 0
