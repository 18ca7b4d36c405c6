"""Where one launch's time goes, block by block: the kernel built with VMLA_TRACE stamps %globaltimer at each
block's start and end and at five points of each segment (start, Q and slot ids landed, first tile landed, tile
loop done, outputs written). One device call; prints a summary per case, writes trace.json to $OUT.

Usage: python3 tools/trace_case.py "small tree" "small tree N8" [--reps 5]   (needs a GPU)
(Bench cases match by substring, kdtree.bench.PROBE_CASES by their exact name.)
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from kdtree import bench  # noqa: E402
from kdtree.kernel import KernelConfig, VerifyKernel, device_arch, plan  # noqa: E402


def segment_tiles(p) -> list[list[int]]:
    """Key tiles of each segment of each block, in the kernel's order."""
    out = [[] for _ in range(p.grid)]
    for c, _, k0, k1, _ in p.walk():
        out[c].append(k1 - k0)
    return out


def summarize(tr: np.ndarray, tiles: list[list[int]]) -> dict:
    """Times in microseconds from the first block's start."""
    t0 = tr[:, 0].min()
    us = (tr.astype(np.int64) - int(t0)) / 1e3
    seg = {"prologue": [], "first_tile": [], "per_tile": [], "epilogue": []}
    busy, overhead = [], []
    for c, segs in enumerate(tiles):
        o = 0.0
        for s, n in enumerate(segs[:6]):
            e = us[c, 1 + 5 * s : 6 + 5 * s]
            if tr[c, 2 + 5 * s]:  # (the blocks64 segment stamps no "Q and slot ids landed")
                seg["prologue"].append(e[1] - e[0])
                seg["first_tile"].append(e[2] - e[1])
            if n > 1:
                seg["per_tile"].append((e[3] - e[2]) / n)
            seg["epilogue"].append(e[4] - e[3])
            o += (e[2] - e[0]) + (e[4] - e[3])
        busy.append(us[c, 31] - us[c, 0])
        overhead.append(o)
    q = lambda v: {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v))}  # noqa: E731
    return {
        "block_start": q(us[:, 0]),
        "block_end": q(us[:, 31]),
        "kernel_span": float(us[:, 31].max()),
        "block_busy": q(busy),
        "block_segment_overhead": q(overhead),
        **{k: q(v) for k, v in seg.items() if v},
        "segments_per_block": q([len(s) for s in tiles]),
        "tiles_per_block": q([sum(s) for s in tiles]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel (repeatable)")
    ap.add_argument("--segment-units", type=float, nargs="*", default=[None], help="plan(segment_units=...) values to trace")
    ap.add_argument("--blocks64", action="store_true", help="the blocks64 body alone (Hopper; no few-row tiles)")
    ap.add_argument("--align-shares", type=float, default=None, help="plan(align_shares=...): long requests' tiles cut alike")
    a = ap.parse_args()
    cases = bench.select_cases(a.cases, probes=True)
    base = KernelConfig.for_arch(device_arch())
    if a.blocks64:
        base = KernelConfig.for_arch("sm_90a-blocks64")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    max_grid = torch.cuda.get_device_properties(0).multi_processor_count * base.blocks_per_sm  # plan()'s largest grid
    config = base.with_defines([*a.define, f"VMLA_TRACE={max_grid}"])
    kern = VerifyKernel.get(config)
    trace_all = kern.cupy.ndarray((max_grid, 32), dtype=kern.cupy.uint64, memptr=kern.module.get_global("vmla_trace"))
    results = {}
    for case, su in ((c, su) for c in cases for su in a.segment_units):

        def plan_fn(args, H, su=su):
            return plan(args, H, kern.num_sms, config, segment_units=su, align_shares=a.align_shares)

        run = bench.case_launch(case, plan_fn)
        p = run.plan
        aligned = p.aligned
        trace = trace_all[: p.grid]  # this plan's blocks
        tiles = segment_tiles(p)
        reps = []
        for _ in range(a.reps):
            flush.zero_()
            trace.fill(0)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            run.launch(kern)
            ev[1].record()
            torch.cuda.synchronize()
            raw = trace.get()
            s = summarize(raw, tiles)
            s["event_ms_with_merge"] = ev[0].elapsed_time(ev[1])
            s["raw_us"] = ((raw.astype(np.int64) - int(raw[:, 0].min())) / 1e3).round(3).tolist()
            reps.append(s)
        best = sorted(reps, key=lambda r: r["kernel_span"])[len(reps) // 2]  # the median launch
        name = (
            case.name
            + ("" if su is None else f" segment_units={su:g}")
            + (f" aligned at align_shares={a.align_shares:g}" if aligned else "")
        )
        results[name] = {"grid": p.grid, "units": p.units, "segments": p.segments, "tiles": tiles, "median_launch": best}
        print(f"{name}: grid {p.grid}, units {p.units}, segments {p.segments}, merge kernel {p.split and not p.fused_merge}")
        print(
            f"   launch (events, fwd + merge) {best['event_ms_with_merge'] * 1e3:.1f} us; fwd span {best['kernel_span']:.1f} us"
        )
        for k, v in best.items():
            if isinstance(v, dict):
                print(f"   {k:24s} mean {v['mean']:7.2f}  min {v['min']:7.2f}  max {v['max']:7.2f}")
        sys.stdout.flush()
    Path(os.environ.get("OUT", "."), "trace.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
