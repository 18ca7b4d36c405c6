"""The stream-K launch plan on the host: row tiles x key tiles shared by a persistent grid (`plan`,
`balanced_split`), the cost model that picks a configuration per batch (`choose_plan`), and the workspace a
plan's split tiles need. docs/kernel-design.md, "Stream-K plan" and "Cost model"."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from kdtree.kernel.config import FUSED_MERGE_SEGS, POOL_ROW_BYTES, KernelConfig
from kdtree.marshal import VerifyArgs

# The plan arrays verify_mla_fwd takes, in its parameter order (kdtree.kernel.launch.FwdParams)
FWD_ARRAYS = ("cta_unit_start", "cta_first_rt", "rt_unit_start", "rt_request", "rt_row0", "rt_first_cta", "rt_seg_base")
# (+ verify_mla_merge's per-row (first partial line, partials), [T * H, 2])
PLAN_ARRAYS = FWD_ARRAYS + ("row_merge",)


@dataclass
class LaunchPlan:
    """A stream-K split of one batch: the (row tile, key tile) work units shared by `grid` blocks (`balanced_split`,
    or `aligned_split` where `aligned`).

    The arrays are int32; `to(device)` moves them once, before any launch or graph capture. For CUDA-graph
    replay with other lengths, plan again and copy the new arrays into the captured ones (same sizes when
    planned from the same upper bounds).
    """

    batch_size: int
    num_heads: int
    total_rows: int  # T * H
    mask_words: int
    grid: int  # persistent blocks
    units: int  # (row tile, key tile) work units
    work: float  # the units weighted by their row tile's cost (few-row tiles are cheaper)
    segments: int  # partial slots (row tiles split across blocks, one slot per block touching them)
    fused_merge: bool  # the last block of each split tile merges it (no verify_mla_merge launch)
    config: KernelConfig
    arrays: dict[str, torch.Tensor] = field(repr=False)
    # per block, on the host (for `estimated_cost`; None from the device planner): its weighted units, and the
    # row tiles it works on (segments it runs)
    block_work: np.ndarray | None = field(default=None, repr=False)
    block_segments: np.ndarray | None = field(default=None, repr=False)
    # ... and its weighted units with each segment padded as its body runs it (`padded_units`)
    block_padded_work: np.ndarray | None = field(default=None, repr=False)
    aligned: bool = False  # some request's row tiles cut at common key offsets (`aligned_split`)
    visible_keys: bool = True  # row tiles end at the last key their rows may see (`plan(visible_keys=...)`)

    @property
    def split(self) -> bool:
        return self.segments > 0

    @property
    def row_tiles(self) -> int:
        return len(self.arrays["rt_request"])

    def to(self, device) -> "LaunchPlan":
        return dataclasses.replace(self, arrays={k: v.to(device) for k, v in self.arrays.items()})

    def walk(self) -> list[tuple[int, int, int, int, int | None]]:
        """verify_mla_fwd's loop replayed on the host: (block, row tile, first key tile, end key tile, partial
        slot or None) for every segment, block by block, each block's in the order it runs them: its last segment
        first (`KernelConfig.last_segment_first`), then the others in unit order (tests and tools/trace_case.py)."""
        a = {k: v.cpu().numpy() for k, v in self.arrays.items()}
        out = []
        for c in range(self.grid):
            block = []
            u, u_end, rt = a["cta_unit_start"][c], a["cta_unit_start"][c + 1], a["cta_first_rt"][c]
            while u < u_end:
                t0, t1 = a["rt_unit_start"][rt], a["rt_unit_start"][rt + 1]
                seg_end = min(u_end, t1)
                segs = a["rt_seg_base"][rt + 1] - a["rt_seg_base"][rt]
                slot = int(a["rt_seg_base"][rt] + (c - a["rt_first_cta"][rt])) if segs > 1 else None
                block.append((c, int(rt), int(u - t0), int(seg_end - t0), slot))
                u, rt = seg_end, rt + 1
            out += block[-1:] + block[:-1] if self.config.last_segment_first else block
        return out


# What the split weighs a segment beyond its tiles, in units: its prologue, first tile's wait and store
# (fitted: docs/kernel-design.md, Cost model).
SEGMENT_OVERHEAD_UNITS = 5.0
# A unit of a few-row tile (the wgmma body's mma.sync few-row segment) in units of the configuration's 64-row
# body's unit, split_keys (FEW_UNIT_COST) or dims_split (FEW_UNIT_COST_DIMS) (fitted: docs/kernel-design.md,
# Cost model).
FEW_UNIT_COST = 0.8
FEW_UNIT_COST_DIMS = 0.6
# A row tile of at most SHORT_TILE_UNITS key tiles (512 keys) is short: its segment pays a fixed cost its few
# units do not amortise, SHORT_SEGMENT_UNITS more (fitted: docs/kernel-design.md, Cost model).
SHORT_TILE_UNITS = 16
SHORT_SEGMENT_UNITS = 6.0


def few_row_weight(config: KernelConfig) -> float:
    """What a few-row unit costs in units of the configuration's 64-row body."""
    return FEW_UNIT_COST if config.split_keys else FEW_UNIT_COST_DIMS


def last_visible_draft_key(tree_mask: torch.Tensor) -> torch.Tensor:
    """Per token, the last draft key its tree-mask row may see (bit j of tree_mask[t] set: draft key j), or -1
    where it sees none; int64, on the mask's device (torch ops: the host and the device planner share it)."""
    words = tree_mask.long() & 0xFFFFFFFF
    if words.shape[1] == 0:
        return torch.full(words.shape[:1], -1, dtype=torch.int64, device=words.device)
    idx = torch.arange(words.shape[1], device=words.device)
    last = torch.where(words != 0, idx, -1).amax(1)
    word = words.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    bit_length = torch.frexp(word.double()).exponent.long()  # exact for 32-bit words
    return torch.where(last >= 0, 32 * last + bit_length - 1, -1)


def row_tile_key_tiles(
    tree_mask: torch.Tensor,
    rt_token0: torch.Tensor,
    rt_row0: torch.Tensor,
    tile_rows: torch.Tensor,
    prefix: torch.Tensor,
    kv: torch.Tensor,
    num_heads: int,
    config: KernelConfig,
) -> torch.Tensor:
    """Key tiles each row tile visits: its request's prefix and its draft keys up to the last one any of its rows
    may see (a draft key after that is masked for every row of the tile, so skipping it changes no output);
    never past the request's keys, and at least one (a request with no keys still owns a unit: it writes o = 0).
    Row tile rt holds rows [rt_row0, rt_row0 + tile_rows) of the request whose first token is rt_token0; tokens
    are clamped into the mask's rows, so lengths that disagree with it (a server's scratch rows) read a wrong
    row, never past the buffer."""
    span = (config.bm - 1) // num_heads + 2  # nodes a tile of bm rows can touch
    lo = rt_row0 // num_heads
    hi = (rt_row0 + tile_rows - 1) // num_heads
    nodes = torch.minimum(lo.unsqueeze(1) + torch.arange(span, device=lo.device), hi.unsqueeze(1))
    tokens = (rt_token0.unsqueeze(1) + nodes).clamp(0, tree_mask.shape[0] - 1)
    last = last_visible_draft_key(tree_mask)[tokens].amax(1)
    keys = torch.minimum(prefix + last + 1, kv)
    return torch.clamp(-(-keys // config.bn), min=1)


# The split's weights count in ticks, integer thousandths of a unit: every running sum and quotient is int64
# arithmetic, exact on any device, so the device planner's boundaries are the host's whatever order its scan adds.
SPLIT_TICKS = 1000


def split_ticks(x) -> np.ndarray:
    """Weights (units) as int64 ticks of 1/SPLIT_TICKS unit. A weight must be a whole number of ticks (0.8, 5, 6:
    thousandths), so that a sum of weights rounds as its parts do on either planner; ValueError otherwise."""
    t = np.asarray(x, dtype=np.float64) * SPLIT_TICKS
    ticks = np.rint(t)
    if not np.all(np.abs(t - ticks) <= 1e-6 * np.maximum(1.0, np.abs(t))):
        raise ValueError(f"split weights count in thousandths of a unit (SPLIT_TICKS); got {np.unique(x)}")
    return ticks.astype(np.int64)


def balanced_split(
    rt_unit_start: np.ndarray, grid: int, segment_units: float | np.ndarray, rt_weight: np.ndarray | None = None
) -> np.ndarray:
    """Block boundaries [grid + 1] over the units that even out each block's work + segment_units per row tile
    it starts or continues (0: equal unit counts; an array: each row tile's own). A unit of row tile rt is
    rt_weight[rt] of work (default 1; few-row tiles are cheaper). Every block keeps at least one unit. Weights
    are rounded to ticks (`SPLIT_TICKS`) and summed as integers.

    The cost of units [a, b) is W(b) - W(a) + the segment cost of a's row tile, with W(u) = the work of the units
    before u + the segment costs of the row tiles after the first, up to u's: equal steps of W give about equal
    costs, and a boundary that falls in the jump before a row tile lands on its start (no split)."""
    units = int(rt_unit_start[-1])
    starts = rt_unit_start[:-1].astype(np.int64)
    seg = np.broadcast_to(split_ticks(segment_units), starts.shape)
    if not (seg > 0).any():
        return np.arange(grid + 1) * units // grid
    weight = np.full(len(starts), SPLIT_TICKS) if rt_weight is None else split_ticks(rt_weight)
    if (weight <= 0).any() or (seg < 0).any():
        raise ValueError("balanced_split: a unit's weight must be at least one tick and a segment cost not negative")
    work = np.diff(rt_unit_start).astype(np.int64) * weight
    cum, jumps = np.cumsum(work), np.concatenate([[0], np.cumsum(seg[1:])])
    w_start = np.concatenate([[0], cum[:-1]]) + jumps  # W at each row tile's first unit
    w = np.arange(1, grid) * (cum[-1] + jumps[-1]) // grid
    rt = np.searchsorted(w_start, w, side="right") - 1
    # the nearest unit to w in row tile rt (halves up), never past the tile's end
    inner = np.minimum(rt_unit_start[rt + 1], starts[rt] + (2 * (w - w_start[rt]) + weight[rt]) // (2 * weight[rt]))
    bounds = np.concatenate([[0], inner, [units]])
    idx = np.arange(grid + 1)
    bounds = np.maximum.accumulate(np.maximum(bounds, 0) - idx) + idx  # strictly increasing ...
    return np.minimum(bounds, units - grid + idx)  # ... and every block keeps a unit (grid <= units)


def weighted_units(bounds: np.ndarray, rt_unit_start: np.ndarray, rt_weight) -> np.ndarray:
    """Each block's units x their row tile's weight (the weighted work before a bound is piecewise linear in it)."""
    work = np.concatenate([[0.0], np.cumsum(np.diff(rt_unit_start) * np.asarray(rt_weight, dtype=np.float64))])
    return np.diff(np.interp(bounds, rt_unit_start, work))


def block_costs(bounds: np.ndarray, rt_unit_start: np.ndarray, segment_units, rt_weight) -> np.ndarray:
    """Each block's work as `balanced_split` weighs it: its weighted units plus the segment cost of every row tile
    it touches."""
    seg = np.broadcast_to(np.asarray(segment_units, dtype=np.float64), (len(rt_unit_start) - 1,))
    first = np.searchsorted(rt_unit_start, bounds[:-1], side="right") - 1
    last = np.searchsorted(rt_unit_start, bounds[1:] - 1, side="right") - 1
    touched = np.concatenate([[0.0], np.cumsum(seg)])
    return weighted_units(bounds, rt_unit_start, rt_weight) + touched[last + 1] - touched[first]


ALIGN_SLACK = 1.06  # an aligned split may put this much more work than the balanced one into its largest block
# `choose_plan`'s aligned candidate, on blocks64: a request is cut alike where each of its row tiles is worth at
# least ALIGN_SHARES blocks' shares, and the split weighs a segment ALIGN_SEGMENT_UNITS (a short tile's
# SHORT_SEGMENT_UNITS more): a segment costs more where its keys are read by several blocks together
# (fitted: docs/kernel-design.md, Cost model).
ALIGN_SHARES = 6.0
ALIGN_SEGMENT_UNITS = 12.0


def aligned_split(
    rt_unit_start: np.ndarray,
    rt_request: np.ndarray,
    grid: int,
    segment_units,
    rt_weight,
    min_shares: float,
    pad: int = 1,
) -> np.ndarray | None:
    """Block boundaries [grid + 1] that cut every row tile of each long request (at least two row tiles, each worth
    at least `min_shares` of a block's mean share of the work and at least 2 `pad` units) into the same number of
    pieces at the same key offsets (multiples of `pad` units), one block a piece: the request's blocks then read
    each key at about the same time, so its pool rows leave HBM once for all its row tiles, as they do where each
    block holds one whole row tile (docs/kernel-design.md, "Pool rows over L2"). The runs of other row tiles between
    them keep about their share of blocks, each run balanced as `balanced_split` balances it; with no other row tiles
    the grid shrinks to the pieces (fewer pieces a tile where the grid cannot hold them all). None where no request
    is that long, where the runs cannot keep their blocks, or where the largest block would hold more than
    ALIGN_SLACK times the balanced split's largest."""
    n = len(rt_unit_start) - 1
    seg = np.array(np.broadcast_to(np.asarray(segment_units, dtype=np.float64), (n,)))
    weight = np.array(np.broadcast_to(np.asarray(rt_weight, dtype=np.float64), (n,)))
    units_rt = np.diff(rt_unit_start).astype(np.int64)
    work_rt = units_rt * weight + seg
    share = work_rt.sum() / grid
    pieces, shortest = {}, {}  # per long request: pieces a row tile (about a share each), its shortest tile's units
    for r in np.unique(rt_request):
        tiles = np.flatnonzero(rt_request == r)
        k0 = int(units_rt[tiles].min())
        if len(tiles) < 2 or work_rt[tiles].min() < min_shares * share or k0 // pad < 2:
            continue
        pieces[int(r)] = int(max(2, min(round(work_rt[tiles].mean() / share), k0 // pad)))
        shortest[int(r)] = k0
    if not pieces:
        return None
    runs = []  # maximal runs [i, j) of other row tiles
    for rt in np.flatnonzero(~np.isin(rt_request, list(pieces))):
        if runs and runs[-1][1] == rt:
            runs[-1] = (runs[-1][0], rt + 1)
        else:
            runs.append((rt, rt + 1))
    run_work = np.array([work_rt[i:j].sum() for i, j in runs])
    tiles_of = {r: int((rt_request == r).sum()) for r in pieces}

    def split(pieces: dict) -> np.ndarray | None:
        free = grid - sum(pieces[r] * tiles_of[r] for r in pieces)
        if free < len(runs):  # (with no runs, free blocks are left out: the grid shrinks to the pieces)
            return None
        blocks = np.zeros(len(runs), dtype=np.int64)
        if runs:  # the free blocks over the runs in proportion to their work: at least one each, largest remainders
            exact = free * run_work / run_work.sum()
            blocks = np.maximum(1, np.floor(exact).astype(np.int64))
            while blocks.sum() > free:
                blocks[np.argmin(np.where(blocks > 1, exact - blocks, np.inf))] -= 1
            while blocks.sum() < free:
                blocks[np.argmax(exact - blocks)] += 1
            if any(b > units_rt[i:j].sum() for b, (i, j) in zip(blocks, runs)):
                return None
        bounds, run_of, rt = [], {i: k for k, (i, _) in enumerate(runs)}, 0
        while rt < n:
            if rt in run_of:
                i, j = runs[run_of[rt]]
                sub = balanced_split(rt_unit_start[i : j + 1] - rt_unit_start[i], int(blocks[run_of[rt]]), seg[i:j], weight[i:j])
                bounds += (sub[:-1] + rt_unit_start[i]).tolist()
                rt = j
                continue
            r = int(rt_request[rt])
            m, k0 = pieces[r], shortest[r]  # (offsets within the shortest tile: the longer ones' extra keys go last)
            bounds += [int(rt_unit_start[rt]) + pad * int(k * k0 / m / pad + 0.5) for k in range(m)]  # (halves up)
            rt += 1
        bounds = np.array(bounds + [int(rt_unit_start[-1])], dtype=np.int64)
        return bounds if (np.diff(bounds) > 0).all() else None

    # pieces a tile: each long request's nearest count to a share a piece, one fewer or one more, the combination
    # whose largest block holds the least work; with no other row tiles, the most pieces the grid holds
    while not runs and sum(pieces[r] * tiles_of[r] for r in pieces) > grid:
        r = max((r for r in pieces if pieces[r] > 2), key=lambda r: pieces[r], default=None)
        if r is None:
            return None
        pieces[r] -= 1
    options = [[m for m in (pieces[r] - 1, pieces[r], pieces[r] + 1) if 2 <= m <= shortest[r] // pad] for r in pieces]
    best, best_cost = None, np.inf
    for combo in itertools.islice(itertools.product(*options), 81):
        bounds = split(dict(zip(pieces, combo)))
        if bounds is not None and (cost := block_costs(bounds, rt_unit_start, seg, weight).max()) < best_cost:
            best, best_cost = bounds, cost
    if best is None:
        return None
    balanced = balanced_split(rt_unit_start, grid, seg, weight)
    return None if best_cost > ALIGN_SLACK * block_costs(balanced, rt_unit_start, seg, weight).max() else best


def plan(
    args: VerifyArgs,
    num_heads: int,
    num_sms: int,
    config: KernelConfig,
    *,
    fused_merge: bool | None = None,
    segment_units: float | None = None,
    few_unit_cost: float | None = None,
    visible_keys: bool = True,
    grid: int | None = None,
    short_segment_units: float = SHORT_SEGMENT_UNITS,
    align_shares: float | None = None,
) -> LaunchPlan:
    """Cut the batch into row tiles x key tiles (with `visible_keys`, a row tile's keys end at the last draft key
    its rows may see: `row_tile_key_tiles`; else every row tile takes all its request's keys, which keeps the row
    tiles of equal requests equal) and share the units among the persistent blocks
    (`config.blocks_per_sm` per SM) so that each block's units plus `segment_units` (default
    SEGMENT_OVERHEAD_UNITS; a short row tile's `short_segment_units` more; 0: equal unit counts) per segment come
    out even (`balanced_split`; a request's last row tile costs about as
    much per unit as a full one, measured: weighting it lighter was slower - except a tile of at most
    `config.few_rows` rows, which the few-row segment runs at `few_unit_cost` of a unit; default
    `few_row_weight(config)`).
    `fused_merge` (default: when no tile is split into more than FUSED_MERGE_SEGS partials, on the mma.sync
    paths) lets the kernel merge split tiles itself instead of launching verify_mla_merge. `grid` caps the
    persistent blocks below one per SM slot (`tools/variants.py`: whole row tiles a block). `align_shares`: the
    row tiles of requests whose tiles are each worth at least that many blocks' shares are cut at common key offsets
    (`aligned_split`, `choose_plan`'s aligned candidate), the rest balanced as before."""
    if grid is not None and grid < 1:
        raise ValueError(f"plan: grid must be at least 1 block, got {grid}")
    n = (args.qo_indptr[1:] - args.qo_indptr[:-1]).numpy().astype(np.int64)
    kv = (args.combined_kv_indptr[1:] - args.combined_kv_indptr[:-1]).numpy().astype(np.int64)
    row_tiles = -(-n * num_heads // config.bm)
    rt_request = np.repeat(np.arange(len(n)), row_tiles)
    rt_row0 = np.concatenate([np.arange(r) * config.bm for r in row_tiles])
    tile_rows = np.minimum(config.bm, n[rt_request] * num_heads - rt_row0)
    if visible_keys:
        i64 = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))  # noqa: E731
        qo0, prefix = args.qo_indptr.numpy()[rt_request], args.prefix_lens.numpy()[rt_request]
        key_tiles = row_tile_key_tiles(
            args.tree_mask, i64(qo0), i64(rt_row0), i64(tile_rows), i64(prefix), i64(kv[rt_request]), num_heads, config
        ).numpy()
    else:
        key_tiles = np.maximum(1, -(-kv[rt_request] // config.bn))
    rt_unit_start = np.concatenate([[0], np.cumsum(key_tiles)])
    units = int(rt_unit_start[-1])
    grid = max(1, min(num_sms * config.blocks_per_sm, units, units if grid is None else grid))
    few = few_row_weight(config) if few_unit_cost is None else few_unit_cost
    rt_weight = np.where(tile_rows <= config.few_row_limit, few, 1.0)
    seg_units = SEGMENT_OVERHEAD_UNITS if segment_units is None else segment_units
    split_ticks([seg_units, short_segment_units])  # whole ticks each (so their sum rounds as on the device)
    rt_segment = seg_units + np.where((key_tiles <= SHORT_TILE_UNITS) & (seg_units > 0), short_segment_units, 0.0)
    cta_unit_start = None
    if align_shares is not None:
        cta_unit_start = aligned_split(rt_unit_start, rt_request, grid, rt_segment, rt_weight, align_shares, padded_units(config))
    aligned = cta_unit_start is not None
    if not aligned:
        cta_unit_start = balanced_split(rt_unit_start, grid, rt_segment, rt_weight)
    grid = len(cta_unit_start) - 1
    cta_first_rt = np.searchsorted(rt_unit_start, cta_unit_start[:-1], side="right") - 1
    rt_first_cta = np.searchsorted(cta_unit_start, rt_unit_start[:-1], side="right") - 1
    rt_last_cta = np.searchsorted(cta_unit_start, rt_unit_start[1:] - 1, side="right") - 1
    segs = rt_last_cta - rt_first_cta + 1
    cta_last_rt = np.searchsorted(rt_unit_start, cta_unit_start[1:] - 1, side="right") - 1
    # every (block, row tile) segment: its block, its row tile, its units
    counts = cta_last_rt - cta_first_rt + 1
    seg_block = np.repeat(np.arange(grid), counts)
    seg_rt = cta_first_rt[seg_block] + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    seg_n = np.minimum(cta_unit_start[seg_block + 1], rt_unit_start[seg_rt + 1]) - np.maximum(
        cta_unit_start[seg_block], rt_unit_start[seg_rt]
    )
    few_tile = tile_rows[seg_rt] <= config.few_row_limit  # (the few-row segment streams single tiles)
    pad = padded_units(config)
    padded = np.where(few_tile, seg_n, -(-seg_n // pad) * pad) * rt_weight[seg_rt]
    rt_seg_base = np.concatenate([[0], np.cumsum(np.where(segs > 1, segs, 0))])
    if fused_merge is None:  # not for the wgmma body: its merge kernel was faster (docs/kernel-design.md, "Merge")
        fused_merge = bool(segs.max() <= FUSED_MERGE_SEGS) and not config.wgmma
    elif fused_merge and segs.max() > FUSED_MERGE_SEGS:
        raise ValueError(
            f"fused merge takes tiles of at most {FUSED_MERGE_SEGS} partials; this plan splits one into {segs.max()}"
        )
    # global rows (token * H + head) run row tile by row tile: each row's tile and its row in that tile
    total_rows = int(tile_rows.sum())
    row_rt = np.repeat(np.arange(len(rt_request)), tile_rows)
    tr = np.arange(total_rows) - np.repeat(np.cumsum(tile_rows) - tile_rows, tile_rows)
    row_segs = np.where(segs > 1, segs, 0)[row_rt]
    row_merge = np.stack([np.where(row_segs > 0, rt_seg_base[row_rt] * config.bm + tr, 0), row_segs], axis=1)
    arrays = dict(
        zip(
            PLAN_ARRAYS,
            (cta_unit_start, cta_first_rt, rt_unit_start, rt_request, rt_row0, rt_first_cta, rt_seg_base, row_merge.reshape(-1)),
        )
    )
    return LaunchPlan(
        batch_size=len(n),
        num_heads=num_heads,
        total_rows=total_rows,
        mask_words=int(args.tree_mask.shape[1]),
        grid=grid,
        units=units,
        work=float(key_tiles @ rt_weight),
        segments=int(rt_seg_base[-1]),
        fused_merge=fused_merge and bool(rt_seg_base[-1] > 0),
        config=config,
        arrays={k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int32)) for k, v in arrays.items()},
        block_work=weighted_units(cta_unit_start, rt_unit_start, rt_weight),
        block_segments=counts,
        block_padded_work=np.bincount(seg_block, weights=padded, minlength=grid),
        aligned=aligned,
        visible_keys=visible_keys,
    )


# Relative time of one (row tile, key tile) unit by segment body, in split_keys wgmma units, over unpadded units
# (`estimated_cost` applies them to padded ones) (fitted: docs/kernel-design.md, Cost model).
UNIT_COST = {"wgmma64": 1.0, "blocks64": 0.82, "mma64": 1.8, "mma32": 1.15}
# What a segment adds beyond its units (prologue, pipeline fill, store), a row, in wgmma units, with its units
# padded as its body runs them (`padded_units`); x SEGMENT_COST_SCALE on blocks64 (fitted: docs/kernel-design.md,
# Cost model; tools/choose_check.py times every candidate beside the pick).
SEGMENT_COST_PER_ROW = 9.0 / 64
SEGMENT_COST_SCALE = {"blocks64": 10.0 / 9.0}
# A split plan's extra cost where the batch's pool rows exceed L2 (`choose_plan`): its blocks read the keys at
# every offset at once, from HBM (fitted: docs/kernel-design.md, Cost model).
L2_SPREAD_COST = 0.2


def cost_kind(config: KernelConfig) -> str:
    """The cost model's name for a configuration's segment body: `blocks64`, `wgmma64` (the other wgmma bodies,
    split_keys and dims_split) or `mma<bm>` (mma.sync)."""
    return "blocks64" if config.blocks64 else f"{'wgmma' if config.wgmma else 'mma'}{config.bm}"


def padded_units(config: KernelConfig) -> int:
    """The key tiles a segment of the configuration's body is rounded up to: pairs of 64-key blocks (4 tiles) on
    blocks64, the two tiles of a 64-key step on split_keys, single tiles otherwise (the mma.sync and dims_split
    bodies and the few-row segment)."""
    return 4 if config.blocks64 else 2 if (config.wgmma and config.split_keys) else 1


def estimated_cost(p: LaunchPlan, model=None) -> float:
    """A plan's time in wgmma units (for choosing between configurations, not a prediction in ms): its slowest
    block's, which ends the launch: its weighted units, each segment's padded as its body runs it, x the body's
    unit cost, plus a segment cost for each row tile it works on (a mean over blocks misses short requests
    crowding many segments into one block). Without the host's per-block figures (a device plan), the mean:
    total work (unpadded: the device plan does not know its segments) and partial slots over the grid."""
    kind = cost_kind(p.config)
    unit = UNIT_COST.get(kind, p.config.bm / 64 * UNIT_COST["mma64"])
    segment = SEGMENT_COST_PER_ROW * p.config.bm * SEGMENT_COST_SCALE.get(kind, 1.0)
    if model is not None:  # a `kdtree.tune.CostModel` fitted to the present GPU: its costs where it has them
        unit, segment = model.unit_cost.get(kind, unit), model.segment_cost.get(kind, segment)
    if p.block_padded_work is None:
        return (p.work * unit + p.segments * segment) / p.grid
    return float((p.block_padded_work * unit + p.block_segments * segment).max())


def pool_row_bytes(args: VerifyArgs) -> int:
    """The bytes of the pool rows the batch reads, each request's once (prefix and draft keys, 576 bf16 a row)."""
    return int(args.combined_kv_indptr[-1] - args.combined_kv_indptr[0]) * POOL_ROW_BYTES


def choose_plan(
    args: VerifyArgs,
    num_heads: int,
    num_sms: int,
    configs: tuple[KernelConfig, ...],
    *,
    picks: dict[str, str] | None = None,
    **options,
) -> LaunchPlan:
    """The cheapest of `weighed_plans` (the first on ties); `options` are its keywords (`l2_bytes`, `aligned`,
    `model`). `picks` (a tuning file's): for a batch of a shape class it names, the plan it measured fastest
    there, where that plan is weighed."""
    weighed = weighed_plans(args, num_heads, num_sms, configs, **options)
    return pick_plan(weighed, (picks or {}).get(shape_class(args, num_heads)))


def pick_plan(weighed: list[tuple[LaunchPlan, float]], label: str | None = None) -> LaunchPlan:
    """The weighed plan labelled `label` (`plan_label`) where there is one, else the cheapest (the first on ties)."""
    labels = [plan_label(p) for p, _ in weighed] if label is not None else []
    return weighed[pick_index(labels, [c for _, c in weighed], label)][0]


def pick_index(labels: list[str], costs: list[float], label: str | None = None) -> int:
    """`pick_plan`'s rule on plans given by their labels and costs (`kdtree tune` holds them so): the one labelled
    `label` where there is one, else the cheapest, the first on ties."""
    if label is not None and label in labels:
        return labels.index(label)
    return min(range(len(costs)), key=costs.__getitem__)


def plan_label(p: LaunchPlan) -> str:
    """A weighed plan by its body and options (row tiles over all keys, cut alike, one row tile a block)."""
    return (
        p.config.body
        + ("" if p.visible_keys else " all-keys")
        + (" aligned" if p.aligned else "")
        + (" tile-a-block" if not p.split and p.grid == p.row_tiles else "")
    )


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def shape_class(args: VerifyArgs, num_heads: int) -> str:
    """A batch's class for a tuning file's measured picks: its heads, and the powers of two at or above its
    largest draft, its keys (all requests') and its batch size."""
    keys = int(args.combined_kv_indptr[-1] - args.combined_kv_indptr[0])
    return f"h{num_heads}-n{_pow2(args.max_num_draft)}-k{_pow2(keys)}-b{_pow2(args.batch_size)}"


def weighed_plans(
    args: VerifyArgs,
    num_heads: int,
    num_sms: int,
    configs: tuple[KernelConfig, ...],
    *,
    l2_bytes: int | None = None,
    aligned: bool = True,
    model=None,
) -> list[tuple[LaunchPlan, float]]:
    """Every plan `choose_plan` weighs, with the cost it weighs it by: the batch planned with each configuration,
    its row tiles ending at their last visible key and not, each costed by `estimated_cost`. Equal row tiles can
    fill the grid one a block with no split, which tiles of uneven lengths (a big tree's) do not.

    A split plan starts its blocks at many offsets into their tiles, so a request's blocks read all of its keys at
    once instead of sweeping them together. Where the batch's pool rows exceed the L2 cache (`l2_bytes`, the
    GPU's; None or 0: unknown) those reads go to HBM: every split plan then costs L2_SPREAD_COST more, and a batch
    with fewer row tiles than blocks is also planned one tile a block, kept where nothing is split
    (docs/kernel-design.md, "Cost model"). On blocks64 a batch with a request long enough to be cut alike
    (ALIGN_SHARES) is also planned so (`aligned_split`, a segment weighed ALIGN_SEGMENT_UNITS; `aligned`=False:
    not), and weighed as any other split plan, L2_SPREAD_COST included: `estimated_cost` has no term for the
    aligned request's keys read together, so the candidate wins by its balance alone. `model`: a cost model fitted
    to the present GPU (`kdtree.tune`) in place of the shipped constants; the plans weighed are the same."""
    options = [(c, v) for c in configs for v in (True, False)]
    plans = [plan(args, num_heads, num_sms, c, visible_keys=v) for c, v in options]
    cut_alike = (
        plan(args, num_heads, num_sms, c, align_shares=ALIGN_SHARES, segment_units=ALIGN_SEGMENT_UNITS)
        for c in configs
        if c.blocks64 and aligned
    )
    cut_alike = [p for p in cut_alike if p.aligned]
    if not l2_bytes or pool_row_bytes(args) <= l2_bytes:
        return [(p, estimated_cost(p, model)) for p in plans + cut_alike]
    whole = [
        plan(args, num_heads, num_sms, c, visible_keys=v, grid=p.row_tiles)
        for (c, v), p in zip(options, plans)
        if p.row_tiles < p.grid
    ]
    return [
        (p, estimated_cost(p, model) * (1 + L2_SPREAD_COST * p.split))
        for p in plans + cut_alike + [p for p in whole if not p.split]
    ]


@dataclass
class Workspace:
    """Preallocated fp32 partials of the row tiles split across blocks, and the fused merge's per-tile counters
    (zeros; the kernel leaves them zero)."""

    part_o: torch.Tensor  # [segments, BM, 512]
    part_lse: torch.Tensor  # [segments, BM]
    rt_counter: torch.Tensor  # [row tiles] int32

    @classmethod
    def for_plan(cls, p: LaunchPlan, device="cuda", *, segments: int | None = None, row_tiles: int | None = None) -> "Workspace":
        """Sized for `p`, or for `segments` slots and `row_tiles` tiles (upper bounds, for graphs replayed with
        other lengths)."""
        n = max(1, segments if segments is not None else p.segments)
        bm = p.config.bm
        return cls(
            torch.empty(n, bm, 512, dtype=torch.float32, device=device),
            torch.empty(n, bm, dtype=torch.float32, device=device),
            torch.zeros(max(1, row_tiles if row_tiles is not None else p.row_tiles), dtype=torch.int32, device=device),
        )
