"""The stream-K launch plan (`kdtree.kernel.plan`) computed in torch ops on the lengths' own device, with shapes
that depend only on (batch size, N, heads, configuration, grid): what a CUDA graph needs, since the plan is
then recorded into the graph and rebuilt on the GPU at every replay from the new prefix lengths.

Where the draft spans more than 4 key tiles, row tiles end at the last key their rows may see, read from the
marshaled tree bits (`PlanShape.visible_keys`; the host planner's `visible_keys`). The grid is fixed (`grid`
blocks); a batch with fewer work units than blocks leaves the trailing blocks empty (`cta_unit_start` repeats
the unit count; the kernel's loop does not run for them), and so does one with fewer row tiles than blocks whose
pool rows exceed the L2 (`PlanShape.l2_bytes`) and whose longest tile is within `L2_SPREAD_COST` of a block's
balanced share: it runs one tile a block, as `kdtree.kernel.choose_plan` would plan it. Row tiles are
never split across an empty block, so the partial slots are those `kdtree.kernel.plan` would give. The split
sums its weights as integer ticks (`kdtree.kernel.planner.SPLIT_TICKS`), so on any device the arrays are the
host planner's bit for bit where the grids and `visible_keys` agree (`tests/test_device_plan.py`: the shipped
captures and random batches on the CPU, and on a GPU in the GPU suite). The fused merge is off (the merge
kernel runs and skips rows that were not split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtree.kernel import (
    PLAN_ARRAYS,
    SEGMENT_OVERHEAD_UNITS,
    SHORT_SEGMENT_UNITS,
    SHORT_TILE_UNITS,
    KernelConfig,
    LaunchPlan,
    few_row_weight,
    row_tile_key_tiles,
)
from kdtree.kernel.planner import L2_SPREAD_COST, POOL_ROW_BYTES, SPLIT_TICKS, split_ticks


@dataclass(frozen=True)
class PlanShape:
    """What fixes the plan's array sizes: one per CUDA graph (batch size and N are the graph's)."""

    batch_size: int
    num_draft: int
    num_heads: int
    config: KernelConfig
    grid: int  # persistent blocks (the kernel's grid, fixed)
    l2_bytes: int | None = None  # the GPU's L2: a batch over it with fewer row tiles than blocks may run one a block

    @property
    def tiles_per_request(self) -> int:
        return -(-self.num_draft * self.num_heads // self.config.bm)

    @property
    def row_tiles(self) -> int:
        return self.batch_size * self.tiles_per_request

    @property
    def total_rows(self) -> int:
        return self.batch_size * self.num_draft * self.num_heads

    @property
    def visible_keys(self) -> bool:
        """Row tiles end at the last key their rows may see (`kdtree.kernel.row_tile_key_tiles`) where the draft
        spans more than 4 key tiles: below that it saves at most a few tiles a row tile, less than its ~8 extra
        torch ops cost a step (docs/kernel-design.md, "Stream-K plan")."""
        return self.num_draft > 4 * self.config.bn

    @property
    def max_segments(self) -> int:
        """Partial slots a plan can need: each of the grid - 1 inner block boundaries splits one tile in two."""
        return max(1, 2 * (self.grid - 1))


def balanced_split_t(
    rt_unit_start: torch.Tensor, grid: int, live: torch.Tensor, rt_segment: torch.Tensor, rt_weight: torch.Tensor
) -> torch.Tensor:
    """`kdtree.kernel.balanced_split` over `live` blocks (a device scalar, <= grid), then grid - live empty
    blocks: [grid + 1] block boundaries. `rt_segment` and `rt_weight`: each row tile's segment cost and unit
    weight in ticks (int64, `kdtree.kernel.planner.SPLIT_TICKS`): integer sums, so the boundaries are the host's
    bit for bit on any device."""
    units = rt_unit_start[-1]
    starts = rt_unit_start[:-1]
    tiles = starts.numel()
    work = (rt_unit_start[1:] - rt_unit_start[:-1]) * rt_weight
    cum, jumps = torch.cumsum(work, 0), torch.cat([work.new_zeros(1), torch.cumsum(rt_segment[1:], 0)])
    w_start = torch.cat([work.new_zeros(1), cum[:-1]]) + jumps
    dev = rt_unit_start.device
    w = torch.arange(1, grid, device=dev) * (cum[-1] + jumps[-1]) // live
    rt = (torch.searchsorted(w_start, w, right=True) - 1).clamp(0, tiles - 1)
    inner = torch.minimum(rt_unit_start[rt + 1], starts[rt] + (2 * (w - w_start[rt]) + rt_weight[rt]) // (2 * rt_weight[rt]))
    bounds = torch.cat([units.new_zeros(1), inner, units.view(1)])
    idx = torch.arange(grid + 1, device=dev)
    bounds = torch.cummax(bounds.clamp(min=0) - idx, 0).values + idx  # strictly increasing ...
    bounds = torch.minimum(bounds, units - live + idx)  # ... every live block keeps a unit
    return torch.where(idx >= live, units, bounds)


def plan_on_device(
    qo_indptr: torch.Tensor,
    combined_kv_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    shape: PlanShape,
    *,
    segment_units: float = SEGMENT_OVERHEAD_UNITS,
    few_unit_cost: float | None = None,
    short_segment_units: float = SHORT_SEGMENT_UNITS,
) -> LaunchPlan:
    """A `LaunchPlan` (fused merge off) of `shape.grid` blocks for this batch (its marshaled lengths and tree
    bits, `kdtree.marshal.VerifyArgs`'s fields), on the indptrs' device.

    `units` and `work` are not known on the host (-1 in the returned plan); `segments` is the bound
    `shape.max_segments`, which sizes the workspace and makes `launch` run the merge kernel."""
    cfg, dev = shape.config, qo_indptr.device
    bs, r = shape.batch_size, shape.tiles_per_request
    R = shape.row_tiles
    kv = (combined_kv_indptr[1 : bs + 1] - combined_kv_indptr[:bs]).long()
    rt_ids = torch.arange(R, device=dev)
    rt_request = rt_ids // r
    rt_row0 = (rt_ids % r) * cfg.bm
    rows_per_request = shape.num_draft * shape.num_heads
    tile_rows = torch.clamp(rows_per_request - rt_row0, max=cfg.bm)
    if not shape.visible_keys:
        key_tiles = torch.clamp(-(-kv[rt_request] // cfg.bn), min=1)
    else:
        key_tiles = row_tile_key_tiles(
            tree_mask,
            qo_indptr[rt_request].long(),
            rt_row0,
            tile_rows,
            prefix_lens[:bs].long()[rt_request],
            kv[rt_request],
            shape.num_heads,
            cfg,
        )
    rt_unit_start = torch.cat([kv.new_zeros(1), torch.cumsum(key_tiles, 0)])
    units = rt_unit_start[-1]
    live = torch.clamp(units, max=shape.grid)
    if shape.l2_bytes and R < shape.grid:  # `choose_plan`'s case, by its penalty alone: one tile a
        # block where the batch's pool rows exceed L2 and its longest tile is within L2_SPREAD_COST of a block's share
        over = combined_kv_indptr[bs].long() * POOL_ROW_BYTES > shape.l2_bytes
        whole = over & (key_tiles.max() * shape.grid < (1 + L2_SPREAD_COST) * units)
        live = torch.where(whole, torch.full_like(live, R), live)
    weight = few_row_weight(cfg) if few_unit_cost is None else few_unit_cost
    few_ticks, seg, short = (int(split_ticks(x)) for x in (weight, segment_units, short_segment_units))
    if few_ticks <= 0 or seg < 0 or short < 0:
        raise ValueError("plan_on_device: a unit's weight must be at least one tick and segment costs not negative")
    few = torch.full((R,), SPLIT_TICKS, dtype=torch.int64, device=dev).masked_fill(tile_rows <= cfg.few_row_limit, few_ticks)
    if seg > 0:
        rt_segment = seg + (key_tiles <= SHORT_TILE_UNITS).long() * short
        cta_unit_start = balanced_split_t(rt_unit_start, shape.grid, live, rt_segment, few)
    else:  # equal unit counts over the live blocks, as the host's balanced_split gives them
        idx = torch.arange(shape.grid + 1, device=dev)
        cta_unit_start = torch.where(idx >= live, units, idx * units // live)
    cta_first_rt = (torch.searchsorted(rt_unit_start, cta_unit_start[:-1], right=True) - 1).clamp(max=R - 1)
    rt_first_cta = torch.searchsorted(cta_unit_start, rt_unit_start[:-1], right=True) - 1
    rt_last_cta = torch.searchsorted(cta_unit_start, rt_unit_start[1:] - 1, right=True) - 1
    segs = rt_last_cta - rt_first_cta + 1
    split = torch.where(segs > 1, segs, 0)
    rt_seg_base = torch.cat([segs.new_zeros(1), torch.cumsum(split, 0)])
    row_rt = torch.arange(shape.total_rows, device=dev) // rows_per_request * r
    within = torch.arange(shape.total_rows, device=dev) % rows_per_request
    row_rt = row_rt + within // cfg.bm
    tr = within % cfg.bm
    row_segs = split[row_rt]
    row_merge = torch.stack([torch.where(row_segs > 0, rt_seg_base[row_rt] * cfg.bm + tr, 0), row_segs], 1)
    arrays = dict(
        zip(
            PLAN_ARRAYS,
            (cta_unit_start, cta_first_rt, rt_unit_start, rt_request, rt_row0, rt_first_cta, rt_seg_base, row_merge.reshape(-1)),
        )
    )
    return LaunchPlan(
        batch_size=bs,
        num_heads=shape.num_heads,
        total_rows=shape.total_rows,
        mask_words=int(tree_mask.shape[1]),
        grid=shape.grid,
        units=-1,
        work=-1.0,
        segments=shape.max_segments,
        fused_merge=False,
        config=cfg,
        arrays={k: v.to(torch.int32) for k, v in arrays.items()},
        visible_keys=shape.visible_keys,
    )
