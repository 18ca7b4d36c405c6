"""Figures as pure functions: data in, matplotlib Figure out (no pyplot state, testable headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

IMPL_COLORS = {"kdtree": "#1f77b4", "sglang": "#d62728", "flashinfer": "#2ca02c", "torch": "#7f7f7f"}


def _case_ticks(axes, names: list[str]) -> None:
    """One tick a bench case under each axis, and the legends."""
    for a in axes:
        a.set_xticks(np.arange(len(names)))
        a.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        a.legend(fontsize=8)


def _finish_case_figure(fig: Figure, axes, names: list[str], title: str) -> Figure:
    """One tick a bench case under each axis, the legends, the title."""
    _case_ticks(axes, names)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def bench_figure(result: dict) -> Figure:
    """Left: time per case for each implementation, with the roofline floor. Right: achieved TFLOP/s
    against the measured matmul ceiling."""
    fig = Figure(figsize=(13, 4.8))
    ax, ax2 = fig.subplots(1, 2)
    _bench_axes(ax, ax2, result)
    names = [c["name"] for c in result["cases"]]
    return _finish_case_figure(fig, (ax, ax2), names, f"{result['device']} - {result.get('sglang', '')[:80]}")


def _bench_axes(ax, ax2, result: dict) -> None:
    cases = result["cases"]
    impls = [i for i in IMPL_COLORS if any("ms" in c["impls"].get(i, {}) for c in cases)]
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
    top = np.nanmax([ceiling, *(c["impls"].get(i, {}).get("tflops", np.nan) for c in cases for i in impls)])
    if np.isfinite(top) and top > 0:
        ax2.set_ylim(0, top * 1.45)  # room above the ceiling for the legend, which would hide the line
    ax2.set_ylabel("TFLOP/s (dense count)")
    ax2.set_title("achieved rate")


def tuned_rows(tune: dict | None) -> list[dict]:
    """The batches of a `kdtree tune` result that the tuned planner picked for (`report_figure` draws these)."""
    return [r for r in ((tune or {}).get("summary") or {}).get("rows", []) if r.get("tuned_ratio") is not None]


def report_figure(bench: dict | None, tune: dict | None, title: str, *, margin: float) -> Figure:
    """`kdtree report`'s figure: the bench's two panels (where it ran) over the tuner's (where it ran): each timed
    batch's shipped and tuned pick over the fastest plan, in percent, with the bar at `margin` (the tuner's
    `PICK_MARGIN`)."""
    rows = tuned_rows(tune)
    has_bench = bool(bench and bench.get("cases"))
    if not (has_bench or rows):
        raise ValueError("report_figure: neither a bench result with cases nor a tune summary with rows")
    fig = Figure(figsize=(13, 4.8 * (has_bench + bool(rows))))
    grid = fig.add_gridspec(has_bench + bool(rows), 2)
    if has_bench:
        ax, ax2 = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
        _bench_axes(ax, ax2, bench)
        _case_ticks((ax, ax2), [c["name"] for c in bench["cases"]])
    if rows:
        ax3 = fig.add_subplot(grid[-1, :])
        x = np.arange(len(rows))
        within = tune["summary"]["within_margin"]  # `kdtree.tune.summary`'s counts
        for k, (key, label, color) in enumerate((("shipped", "shipped constants", "#7f7f7f"), ("tuned", "tuned", "#1f77b4"))):
            pct = [100 * (r[f"{key}_ratio"] - 1) for r in rows]
            ax3.bar(
                x + (k - 0.5) * 0.4,
                pct,
                0.4,
                label=f"{label}: {within[key]} of {len(pct)} within {100 * margin:g} %",
                color=color,
            )
        ax3.axhline(100 * margin, color="black", ls="--", lw=1, label=f"{100 * margin:g} % over the fastest")
        ax3.set_xticks(x)
        ax3.set_xticklabels([r["batch"] for r in rows], rotation=60, ha="right", fontsize=6)
        ax3.set_ylabel("pick's time over the fastest plan's (%)")
        ax3.set_title("the planner's pick on each timed batch (kdtree tune)")
        ax3.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def sglang_bench_figure(result: dict) -> Figure:
    """`kdtree bench --sglang`: left, one verify layer's GPU time, kdtree's and Triton's backend, eager and
    replayed from CUDA graphs; middle, the speedups, with the 5x bar; right, the host time per step outside the
    kernels (eager, and before a graph replay), with the 100 us bar."""
    cases = [c for c in result["cases"] if "layer_ms" in c]
    names = [c["name"] for c in cases]
    x = np.arange(len(cases))
    series = [
        ("triton", "Triton eager"),
        ("triton_graph", "Triton graph"),
        ("kdtree", "kdtree eager"),
        ("kdtree_graph", "kdtree graph"),
    ]
    fig = Figure(figsize=(19, 4.8))
    ax, ax2, ax3 = fig.subplots(1, 3)
    w = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        color = IMPL_COLORS.get("kdtree" if key.startswith("kdtree") else "sglang")
        ax.bar(
            x + (k - 1.5) * w,
            [c["layer_ms"][key] for c in cases],
            w,
            label=label,
            color=color,
            alpha=1.0 if key.endswith("graph") else 0.5,
        )
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer (median, L2 flushed)")
    ax.set_title("one verify layer's forward_extend")
    for k, mode in enumerate(("eager", "graph")):
        ax2.bar(
            x + (k - 0.5) * 0.4,
            [c["speedup"][mode] for c in cases],
            0.4,
            label=mode,
            color=IMPL_COLORS.get("kdtree"),
            alpha=0.5 if mode == "eager" else 1.0,
        )
    ax2.axhline(5, color="black", ls="--", lw=1, label="5x")
    ax2.set_ylabel("Triton backend time / kdtree backend time")
    ax2.set_yscale("log")
    ax2.set_title("speedup over SGLang's Triton backend")
    host = [
        ("kdtree_step", "kdtree eager step"),
        ("triton_metadata", "Triton eager metadata"),
        ("out_graph_kdtree", "kdtree before a replay"),
        ("out_graph_triton", "Triton before a replay"),
    ]
    w3 = 0.8 / len(host)
    for k, (key, label) in enumerate(host):
        ax3.bar(
            x + (k - 1.5) * w3,
            [c["host_us"].get(key, np.nan) for c in cases],
            w3,
            label=label,
            color=IMPL_COLORS.get("kdtree" if key.endswith("kdtree") or key.startswith("kdtree") else "sglang"),
            alpha=1.0 if key.startswith("out_graph") else 0.5,
        )
    ax3.axhline(100, color="black", ls="--", lw=1, label="100 us")
    ax3.set_yscale("log")
    ax3.set_ylabel("host us per verify step (median)")
    ax3.set_title("host work outside the kernels, per step")
    return _finish_case_figure(fig, (ax, ax2, ax3), names, f"{result['device']} - SGLang {result.get('sglang', '?')}")


# ----- masks ---------------------------------------------------------------------------------------
NONE, MIXED, ALL = 0, 1, 2  # block states of a downsampled mask: no cell visible, some, every one
MASK_CMAP = ListedColormap(["#f2f2f2", "#f4a261", "#264653"])
LEAKED, LOST = 3, 4  # a fault's flipped cells: visible where the tree hides the key, hidden where it shows it
FAULT_CMAP = ListedColormap([*MASK_CMAP.colors, "#e63946", "#7b2cbf"])


def server_bench_figure(pairs: list[dict], title: str | None = None) -> Figure:
    """`kdtree bench --server`: a row of panels per heads per rank and a column per draft tokens; the verify
    step's time against the prompt length, kdtree (solid) and Triton (dashed), a colour per batch; each title names
    the gain in tokens/s, `title` (the GPU and the model, say) the whole."""
    heads_list = sorted({p["heads"] for p in pairs}) or [0]
    drafts = sorted({p["draft_tokens"] for p in pairs}) or [0]
    fig = Figure(figsize=(5.2 * len(drafts) + 1.6, 4.2 * len(heads_list)), layout="constrained")
    grid = fig.subplots(len(heads_list), len(drafts), squeeze=False)
    batches = sorted({p["batch"] for p in pairs})
    colors = matplotlib.colormaps["viridis"](np.linspace(0.0, 0.85, max(1, len(batches))))
    for (i, heads), (j, draft) in ((hi, dj) for hi in enumerate(heads_list) for dj in enumerate(drafts)):
        ax = grid[i][j]
        rows = [p for p in pairs if (p["heads"], p["draft_tokens"]) == (heads, draft)]
        if not rows:
            ax.set_axis_off()
            continue
        for color, b in zip(colors, batches):
            pts = sorted((p for p in rows if p["batch"] == b), key=lambda p: p["prompt_len"])
            x = [p["prompt_len"] for p in pts]
            ax.plot(x, [p["kdtree_step_ms"] for p in pts], "-o", color=color, label=f"batch {b} kdtree")
            ax.plot(x, [p["triton_step_ms"] for p in pts], "--s", color=color, alpha=0.7, label=f"batch {b} Triton")
        gains = [p["tokens_per_s_gain"] for p in rows]
        lengths = sorted({p["prompt_len"] for p in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("verify step (ms, decode over HTTP)")
        ax.set_title(
            f"{heads} heads per rank, {draft} draft tokens\ntokens/s kdtree / Triton: {min(gains):.2f}-{max(gains):.2f}x"
        )
        ax.grid(alpha=0.3)
    grid[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def mask_blocks(mask: np.ndarray, max_rows: int = 1024, max_cols: int = 1024) -> tuple[np.ndarray, int, int]:
    """Downsample a bool [rows, cols] mask to at most max_rows x max_cols blocks without losing an isolated
    cell: a block is ALL, NONE or MIXED (one odd cell makes it MIXED). Returns (blocks, rows per block,
    cols per block)."""
    mask = np.asarray(mask, dtype=bool)
    r, c = mask.shape
    fr, fc = max(1, -(-r // max_rows)), max(1, -(-c // max_cols))
    pr, pc = -(-r // fr) * fr, -(-c // fc) * fc
    # pad with copies of the edge so padding never turns a uniform block mixed
    padded = np.pad(mask, ((0, pr - r), (0, pc - c)), mode="edge") if (pr, pc) != (r, c) else mask
    blocks = padded.reshape(pr // fr, fr, pc // fc, fc)
    any_ = blocks.any(axis=(1, 3))
    all_ = blocks.all(axis=(1, 3))
    return np.where(all_, ALL, np.where(any_, MIXED, NONE)).astype(np.uint8), fr, fc


def mask_figure(
    rows: np.ndarray,
    prefix_len: int,
    *,
    first_col: int = 0,
    stride: int | None = None,
    title: str = "",
    zoom: tuple[int, int, int, int] | None = None,
    selected: int | None = None,
    max_cells: int = 1024,
) -> Figure:
    """One request's custom mask as SGLang lays it out: N rows (draft nodes) of prefix_len + N key columns,
    prefix columns then draft columns. `rows` holds columns `first_col ..` of those rows (the draft block:
    `first_col = prefix_len`), and the axes count in the whole row's columns, so every label states the real
    layout. `stride` names the row stride the rows were read at when it is not prefix_len + N (a faulted
    marshaling). `zoom` = (row0, row1, col0, col1), in those columns, crops first; `selected` outlines one node."""
    rows = np.asarray(rows, dtype=bool)
    n = rows.shape[0]
    true_stride = prefix_len + n
    r0, r1, c0, c1 = zoom if zoom is not None else (0, n, first_col, first_col + rows.shape[1])
    view = rows[r0:r1, c0 - first_col : c1 - first_col]
    blocks, fr, fc = mask_blocks(view, max_cells, max_cells)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax = fig.subplots()
    ax.imshow(
        blocks,
        cmap=MASK_CMAP,
        vmin=0,
        vmax=2,
        aspect="auto",
        interpolation="nearest",
        extent=(c0 - 0.5, c0 + blocks.shape[1] * fc - 0.5, r0 + blocks.shape[0] * fr - 0.5, r0 - 0.5),
    )
    if c0 < prefix_len < c1:  # strictly inside the view (c1 is past its last column)
        ax.axvline(prefix_len - 0.5, color="#e76f51", lw=1.5, label=f"draft columns start at prefix_len = {prefix_len}")
    if selected is not None and r0 <= selected < r1:
        ax.axhspan(selected - 0.5, selected + 0.5, fill=False, ec="#e63946", lw=1.5, label=f"node {selected}")
    if stride is not None and stride != true_stride:
        layout = f"rows read at stride {stride}, not prefix_len + N = {prefix_len} + {n} = {true_stride}"
    else:
        layout = f"row stride prefix_len + N = {prefix_len} + {n} = {true_stride}"
    if c0 == prefix_len:  # the view starts at the draft columns: the axis says so (a line there would be the frame)
        layout = f"draft columns from prefix_len = {prefix_len}; " + layout
    ax.set_xlabel(f"key column ({layout})" + (f"; {fc} columns a pixel" if fc > 1 else ""))
    ax.set_ylabel("draft node (row)" + (f"; {fr} a pixel" if fr > 1 else ""))
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(title or "custom mask")
    states = ((ALL, "visible"), (MIXED, "mixed block"), (NONE, "hidden"))
    handles = [Patch(color=MASK_CMAP(i), label=lab) for i, lab in states if (blocks == i).any()]
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def mask_fault_figure(correct: np.ndarray, faulted: np.ndarray, prefix_len: int, stride_used: int) -> Figure:
    """A request's draft block as the kernel must read it (rows at stride prefix_len + N) beside the same block
    read at `stride_used`, every cell the fault flips in a colour of its own: visible where it must be hidden (a
    key that leaks in) or hidden where it must be visible (a key lost)."""
    correct, faulted = np.asarray(correct, dtype=bool), np.asarray(faulted, dtype=bool)
    n = correct.shape[0]
    flipped = correct != faulted
    fig = Figure(figsize=(12, 5.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    cols = np.arange(prefix_len, prefix_len + n)
    titles = (
        f"correct: rows at stride prefix_len + N = {prefix_len} + {n} = {prefix_len + n}",
        f"faulted: rows at stride {stride_used}; {int(flipped.sum())} of {flipped.size} cells flipped",
    )
    cells = (
        np.where(correct, ALL, NONE),
        np.select([flipped & faulted, flipped], [LEAKED, LOST], np.where(faulted, ALL, NONE)),
    )
    for ax, block, t in zip(axes, cells, titles):
        ax.imshow(block, cmap=FAULT_CMAP, vmin=0, vmax=len(FAULT_CMAP.colors) - 1, interpolation="nearest",
                  extent=(cols[0] - 0.5, cols[-1] + 0.5, n - 0.5, -0.5))  # fmt: skip
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("key column (the draft columns of each row)")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0].set_ylabel("draft node (row)")
    axes[0].yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    states = (
        (ALL, "visible"),
        (NONE, "hidden"),
        (LEAKED, "flipped: visible, must be hidden"),
        (LOST, "flipped: hidden, must be visible"),
    )
    handles = [Patch(color=FAULT_CMAP(i), label=lab) for i, lab in states if any((c == i).any() for c in cells)]
    axes[1].legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def key_reads_figure(prefix_slots: np.ndarray, draft_slots: np.ndarray, read_slots: np.ndarray, *, title: str = "") -> Figure:
    """The keys a request's queries must see - its prefix slots (`kv_indices`) then its draft slots
    (`out_cache_loc`) - against the slots a kernel reads (`read_slots`): every key it misses is marked."""
    prefix_slots, draft_slots = np.asarray(prefix_slots), np.asarray(draft_slots)
    must = np.concatenate([prefix_slots, draft_slots])
    read = np.isin(must, np.asarray(read_slots))
    p, n = len(prefix_slots), len(draft_slots)
    kind = np.where(np.arange(len(must)) < p, 0, 1)  # 0 prefix, 1 draft
    img = np.stack([kind, np.where(read, kind, 2)])  # row 0: must read; row 1: read (2 = missed)
    cmap = ListedColormap(["#9ecae1", "#08519c", "#e63946"])
    fig = Figure(figsize=(11, 2.8), layout="constrained")
    ax = fig.subplots()
    ax.imshow(img, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    ax.axvline(p - 0.5, color="black", lw=1)
    ax.set_yticks([0, 1], ["must read", "kernel reads"])
    ax.set_xlabel(f"key (combined list: {p} prefix keys from kv_indices, then {n} draft keys at out_cache_loc)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    missed = int((~read).sum())
    ax.set_title(title or f"{missed} of {len(must)} keys never read")
    handles = [
        Patch(color=cmap(0), label="prefix key"),
        Patch(color=cmap(1), label="draft key"),
        Patch(color=cmap(2), label="missed"),
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def requests_figure(summary: dict) -> Figure:
    """A capture's requests (`kdtree.info.summarize`): the keys each request's queries see - prefix, then its N
    draft tokens - and how scattered its slots lie in the pool (runs of consecutive slots)."""
    reqs = summary["requests"]
    b = np.arange(len(reqs))
    prefix = np.array([r["prefix_len"] for r in reqs])
    draft = np.array([r["num_draft"] for r in reqs])
    runs = np.array([r["slot_runs"] for r in reqs])
    fig = Figure(figsize=(11, 1.8 + 0.35 * len(reqs)), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1]})
    ax.barh(b, prefix, color="#9ecae1", label="prefix keys (kv_indices)")
    ax.barh(b, draft, left=prefix, color="#08519c", label="draft tokens N (out_cache_loc)")
    for i in b:
        ax.text(prefix[i] + draft[i], i, f" {prefix[i]:,} + {draft[i]}", va="center", fontsize=8)
    ax.set_yticks(b, [f"req {i}" for i in b])
    ax.invert_yaxis()
    ax.set_xlabel("keys a request's queries see (prefix_len + N)")
    ax.set_xlim(0, (prefix + draft).max() * 1.25 + 1)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=2, frameon=False)  # above the bars
    ax2.barh(b, runs, color="#6a51a3")
    ax2.set_xlabel("runs of consecutive slots")
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    pool = summary["pool"]
    fig.suptitle(
        f"{Path(summary['path']).name}: {len(reqs)} request(s), {summary['num_heads']} heads; pool "
        f"{pool['referenced_slots']:,} of {pool['pool_size']:,} slots referenced, mean run {pool['mean_run_length']:.1f}",
        fontsize=10,
    )
    return fig


# ----- trees ---------------------------------------------------------------------------------------
def tree_layout(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of every node: y = depth, x = leaves in depth-first order, parents centred over children."""
    parents = np.asarray(parents)
    n = len(parents)
    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    x, y = np.zeros(n), np.zeros(n)
    next_leaf = 0
    stack = [(0, False)]
    while stack:
        node, done = stack.pop()
        if done:
            x[node] = np.mean([x[c] for c in children[node]])
            continue
        if parents[node] >= 0:
            y[node] = y[parents[node]] + 1
        if not children[node]:
            x[node] = next_leaf
            next_leaf += 1
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return x, y


def path_to_root(parents: np.ndarray, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path


def tree_figure(parents: np.ndarray, *, selected: int | None = None, title: str = "") -> Figure:
    """The draft tree (parent = deepest visible earlier node), coloured by depth; `selected` and its path
    to the root are highlighted."""
    parents = np.asarray(parents)
    x, y = tree_layout(parents)
    fig = Figure(figsize=(9, 3.8))
    ax = fig.subplots()
    for i in range(1, len(parents)):
        ax.plot([x[parents[i]], x[i]], [y[parents[i]], y[i]], color="#bbbbbb", lw=0.8, zorder=1)
    sc = ax.scatter(x, y, c=y, cmap="viridis", s=max(6, 600 / max(1, len(parents)) ** 0.5), zorder=2)
    if selected is not None:
        path = path_to_root(parents, selected)
        ax.plot(x[path], y[path], color="#e63946", lw=2.2, zorder=3)
        ax.scatter(x[[selected]], y[[selected]], s=90, facecolors="none", edgecolors="#e63946", lw=2, zorder=4)
    ax.invert_yaxis()
    ax.set_ylabel("depth")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # depths are whole
    ax.set_xticks([])
    ax.set_title(title or f"draft tree: {len(parents)} nodes, depth {int(y.max())}")
    cb = fig.colorbar(sc, ax=ax, label="depth", fraction=0.03)
    cb.locator = matplotlib.ticker.MaxNLocator(integer=True)
    cb.update_ticks()
    fig.tight_layout()
    return fig


# ----- the MLA pool --------------------------------------------------------------------------------
PADDING, FREE = 1, 0  # pool map codes; request b's prefix slots are 2 + 2b, its draft slots 3 + 2b


def pool_codes(pool_slots: int, prefix_slots: list[np.ndarray], draft_slots: list[np.ndarray]) -> np.ndarray:
    """Per slot: FREE, PADDING (slot 0), or which request's prefix / draft tokens live there."""
    codes = np.zeros(pool_slots, dtype=np.int32)
    codes[0] = PADDING
    for b, (p, d) in enumerate(zip(prefix_slots, draft_slots)):
        codes[np.asarray(p, dtype=np.int64)] = 2 + 2 * b
        codes[np.asarray(d, dtype=np.int64)] = 3 + 2 * b
    return codes


def pool_map_image(codes: np.ndarray, width: int = 512, max_rows: int = 512) -> tuple[np.ndarray, int]:
    """Codes wrapped into rows of `width` cells; a cell spans several slots when the pool is large, and
    shows the most specific code among them (draft > prefix > padding > free). Returns (image, slots per cell)."""
    n = len(codes)
    per_cell = max(1, -(-n // (width * max_rows)))
    cells = -(-n // per_cell)
    padded = np.full(cells * per_cell, FREE, dtype=codes.dtype)
    padded[:n] = codes
    binned = padded.reshape(cells, per_cell)
    rank = np.where(binned >= 2, 2 + (binned % 2 == 1), binned)  # draft 3 > prefix 2 > padding 1 > free 0
    pick = binned[np.arange(cells), rank.argmax(axis=1)]
    rows = -(-cells // width)
    img = np.full(rows * width, -1, dtype=np.int32)
    img[:cells] = pick
    return img.reshape(rows, width), per_cell


def request_colors(num_requests: int) -> list[tuple]:
    """(prefix, draft) colours for each request: tab20's light/dark pairs up to ten requests, beyond that hues
    spaced evenly (light and dark of each), so no two requests share a colour."""
    if num_requests <= 10:
        tab = matplotlib.colormaps["tab20"]
        return [(tab(2 * b + 1), tab(2 * b)) for b in range(num_requests)]
    from matplotlib.colors import hsv_to_rgb

    hues = np.linspace(0, 1, num_requests, endpoint=False)
    return [(tuple(hsv_to_rgb((h, 0.35, 1.0))) + (1.0,), tuple(hsv_to_rgb((h, 0.9, 0.65))) + (1.0,)) for h in hues]


def pool_figure(codes: np.ndarray, num_requests: int, *, width: int = 512, max_legend: int = 24) -> Figure:
    """The pool as a map, slot 0 at the top left, `width` cells a row: free slots, slot 0 (padding), each
    request's prefix (light) and draft (dark) slots."""
    img, per_cell = pool_map_image(codes, width)
    pairs = request_colors(num_requests)
    pal = [c for pair in pairs for c in pair]
    cmap = ListedColormap(["#bbbbbb", "#ffffff", "#000000"] + pal)  # -1 = past the pool's end
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    ax = fig.subplots()
    ax.imshow(img + 1, cmap=cmap, vmin=0, vmax=2 + len(pal), aspect="auto", interpolation="nearest")
    slots = len(codes)
    ax.set_title(f"MLA pool: slots 0..{slots - 1:,} (slot 0 is padding, {slots - 1:,} allocatable); {per_cell} a cell")
    row_slots = width * per_cell
    ticks = np.linspace(0, width, 5)
    ax.set_xticks(ticks - 0.5, [f"+{int(t * per_cell):,}" for t in ticks])
    ax.set_xlabel(f"slot within the row ({row_slots:,} slots a row)")
    ax.set_ylabel(f"row (first slot = row x {row_slots:,})")
    handles = [
        Patch(color="#ffffff", ec="#999999", label="free"),
        Patch(color="#000000", label="slot 0 (padding)"),
        Patch(color="#bbbbbb", label="past the pool's end"),
    ]
    for b, (light, dark) in enumerate(pairs[:max_legend]):
        handles += [Patch(color=light, label=f"req {b} prefix"), Patch(color=dark, label=f"req {b} draft")]
    if num_requests > max_legend:
        handles.append(Patch(color="none", label=f"... {num_requests - max_legend} more requests"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), ncols=1 + len(handles) // 26)
    return fig


def kv_row_figure(rows: np.ndarray, slots: list[int], *, labels: list[str] | None = None, latent: int = 512,
                  dtype: str = "bf16", bytes_per_value: int = 2) -> Figure:  # fmt: skip
    """Chosen pool rows as values: the 512 latent columns (c_KV, also V) | the 64 rope columns (k_pe).
    `labels` says what each row is (e.g. "req 4 prefix")."""
    rows = np.asarray(rows, dtype=np.float32)
    width = rows.shape[1]
    fig = Figure(figsize=(11, 1.6 + 0.45 * len(slots)), layout="constrained")
    ax = fig.subplots()
    lim = float(np.nanmax(np.abs(rows))) if np.isfinite(rows).any() else 1.0
    im = ax.imshow(rows, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax.axvline(latent - 0.5, color="black", lw=1.5)
    ax.set_yticks(range(len(slots)))
    ax.set_yticklabels([f"slot {s}" + (f" ({labels[i]})" if labels else "") for i, s in enumerate(slots)])
    ax.set_xlabel(f"column: 0..{latent - 1} latent c_KV (= V) | {latent}..{width - 1} rope k_pe")
    ax.set_title(f"pool rows: kv_buffer [slots, 1, {width}] {dtype}, {width * bytes_per_value:,} B a row ({len(slots)} shown)")
    fig.colorbar(im, ax=ax, fraction=0.03, label="value")
    return fig


# ----- errors --------------------------------------------------------------------------------------
def error_map_figure(
    row_rel: np.ndarray, depths: np.ndarray, *, request_starts: list[int] | None = None, title: str = ""
) -> Figure:
    """Relative error per (node, head), log10, with each node's depth beside it and the requests' first rows
    marked (`request_starts`: qo_indptr without its last entry)."""
    row_rel = np.asarray(row_rel, dtype=np.float64)
    depths = np.asarray(depths)
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax, axd = fig.subplots(1, 2, gridspec_kw={"width_ratios": [12, 1]}, sharey=True)
    im = ax.imshow(np.log10(np.maximum(row_rel, 1e-12)), aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("token row (draft node)")
    ax.set_title(title or "rel error per (node, head)")
    fig.colorbar(im, ax=ax, fraction=0.03, label="log10(rel error)")
    dim = axd.imshow(depths[:, None], aspect="auto", cmap="viridis", interpolation="nearest")
    axd.set_xticks([])
    axd.set_title("depth", fontsize=9)
    cb = fig.colorbar(dim, ax=axd, fraction=0.5, label="depth in the tree")
    cb.locator = matplotlib.ticker.MaxNLocator(integer=True)
    cb.update_ticks()
    for b, start in enumerate(request_starts or []):
        for a in (ax, axd):
            a.axhline(start - 0.5, color="#2ec4b6", lw=1.0)
        ax.annotate(  # below its line, inside the right edge, on white: legible over any colour of the map
            f"req {b}", xy=(1, start - 0.5), xycoords=("axes fraction", "data"), xytext=(-3, -3), textcoords="offset points",
            ha="right", va="top", fontsize=8, bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#2ec4b6", "lw": 0.8},
        )  # fmt: skip
    return fig


def to_png(fig: Figure, dpi: int = 90) -> bytes:
    """PNG bytes of a figure (what notebooks and widgets display: no pyplot state involved)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
