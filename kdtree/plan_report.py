"""How the cost model plans a batch, without a GPU: every plan `choose_plan` weighs on a target (body, row tiles
to their last visible key or over all keys, aligned, balanced or one tile a block), its grid, partial slots,
largest and mean block and most segments a block, the cost it is weighed by, and the pick (`kdtree plan`)."""

from __future__ import annotations

from kdtree.kernel import KernelConfig, LaunchPlan, weighed_plans
from kdtree.kernel.planner import L2_SPREAD_COST, pool_row_bytes
from kdtree.marshal import VerifyArgs

# the GPU a target is planned for unless told otherwise: (name, SMs, L2 MiB) of its part of record
TARGET_GPUS = {"sm_120": ("RTX PRO 6000", 188, 122.0)}
DEFAULT_GPU = ("H200", 132, 60.0)


def target_gpu(target: str) -> tuple[str, int, float]:
    """The GPU `kdtree plan --target` plans for by default: sm_120's RTX PRO 6000, any other target's the H200."""
    return TARGET_GPUS.get(target, DEFAULT_GPU)


def plan_row(p: LaunchPlan, cost: float, picked: bool) -> dict:
    """One weighed plan as numbers (per block: padded units and segments, as `estimated_cost` reads them)."""
    padded, segments = p.block_padded_work, p.block_segments  # (host plans: `weighed_plans` makes no others)
    return {
        "body": p.config.body,
        "keys": "visible" if p.visible_keys else "all",
        "split": "aligned" if p.aligned else ("one tile a block" if not p.split and p.grid == p.row_tiles else "balanced"),
        "grid": p.grid,
        "row_tiles": p.row_tiles,
        "units": p.units,
        "partial_slots": p.segments,
        "max_block_units": float(padded.max()),
        "mean_block_units": float(padded.mean()),
        "max_block_segments": int(segments.max()),
        "cost": float(cost),
        "picked": picked,
    }


def plan_report(
    args: VerifyArgs, num_heads: int, num_sms: int, configs: tuple[KernelConfig, ...], *, l2_bytes: int | None
) -> dict:
    """The batch's pool rows against the L2 (over it, a split plan's cost includes L2_SPREAD_COST) and every plan
    `choose_plan` weighs, cheapest first, its pick (the first of the cheapest) marked."""
    weighed = weighed_plans(args, num_heads, num_sms, configs, l2_bytes=l2_bytes)
    pick = min(range(len(weighed)), key=lambda i: weighed[i][1])
    rows = [plan_row(p, cost, i == pick) for i, (p, cost) in enumerate(weighed)]
    pool = pool_row_bytes(args)
    return {
        "sms": num_sms,
        "l2_mib": l2_bytes / 2**20 if l2_bytes else None,
        "pool_mib": pool / 2**20,
        "over_l2": bool(l2_bytes) and pool > l2_bytes,
        "plans": sorted(rows, key=lambda r: (r["cost"], not r["picked"])),
    }


def format_report(title: str, report: dict) -> str:
    """A fixed-width table of `plan_report`'s plans under a title line, the pick marked with '*'."""
    l2 = "L2 unknown" if report["l2_mib"] is None else f"L2 {report['l2_mib']:g} MiB"
    over = f": over it, split plans cost {L2_SPREAD_COST:.0%} more" if report["over_l2"] else ""
    head = (
        f"{'':2s}{'body':18s} {'keys':7s} {'split':16s} {'grid':>4s} {'tiles':>5s} {'units':>6s} {'slots':>5s} "
        f"{'max blk':>7s} {'mean':>6s} {'segs':>4s} {'cost':>8s}"
    )
    lines = [f"{title}, {report['sms']} SMs, {l2}; pool rows {report['pool_mib']:.1f} MiB{over}", head]
    for r in report["plans"]:
        lines.append(
            f"{'*' if r['picked'] else ' ':2s}{r['body']:18s} {r['keys']:7s} {r['split']:16s} {r['grid']:4d} {r['row_tiles']:5d} "
            f"{r['units']:6d} {r['partial_slots']:5d} {r['max_block_units']:7.1f} {r['mean_block_units']:6.1f} "
            f"{r['max_block_segments']:4d} {r['cost']:8.1f}"
        )
    return "\n".join(lines)
