"""How much of a case's time is its pool rows missing L2. Each case as `kdtree bench` plans it, timed against
- the same launch with every request's prefix keys pointed at the longest request's pool rows (the same number of
  rows read in the same order, but one request's prefix to hold in L2 instead of all of them; the output is wrong,
  the work is not);
- two launches of the case with half of each prefix (what a plan sweeping every request's keys in two halves would
  cost, its merge left out).

Usage: python3 experiments/l2_share.py [--cases substring ...]   (needs a GPU; one line a case)
"""

import argparse
import dataclasses

import triton.testing

from kdtree import bench
from kdtree.kernel import KernelConfig, VerifyKernel, plan
from kdtree.kernel.planner import pool_row_bytes


def shared_prefix(args):
    """`args` with each request's prefix slots replaced by the longest request's first ones."""
    idx, ptr, pre = args.combined_kv_indices.clone(), args.combined_kv_indptr.tolist(), args.prefix_lens.tolist()
    big = max(range(len(pre)), key=pre.__getitem__)
    src = idx[ptr[big] : ptr[big] + pre[big]].clone()
    for r, n in enumerate(pre):
        idx[ptr[r] : ptr[r] + n] = src[:n]
    return dataclasses.replace(args, combined_kv_indices=idx)


def median_ms(kern, run: bench.CaseLaunch) -> float:
    return triton.testing.do_bench(lambda: run.launch(kern), warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["8k x8", "mixed", "32k x2", "32k x4", "128k", "8k x4"])
    ap.add_argument("--blocks64", action="store_true", help="the blocks64 body alone (Hopper), not the cost model's pick")
    ap.add_argument("--segment-units", type=float, default=None, help="with --blocks64: plan(segment_units=...)")
    a = ap.parse_args()
    if a.segment_units is not None and not a.blocks64:
        ap.error("--segment-units needs --blocks64 (the cost model's pick plans with the default weights)")
    if a.blocks64:
        config = KernelConfig.for_arch("sm_90a-blocks64")
        kern = VerifyKernel.get(config)

        def plan_fn(args, num_heads):
            return plan(args, num_heads, kern.num_sms, config, segment_units=a.segment_units)
    else:
        kern = VerifyKernel.get()
        plan_fn = kern.plan
    print(f"L2 {kern.l2_bytes / 2**20:.0f} MiB")
    for case in bench.select_cases(a.cases, probes=True):
        run = bench.case_launch(case, plan_fn)
        own, shared = median_ms(kern, run), median_ms(kern, dataclasses.replace(run, args=shared_prefix(run.args)))
        half = dataclasses.replace(case, prefix_lens=tuple(n // 2 for n in case.prefix_lens))
        halves = 2 * median_ms(kern, bench.case_launch(half, plan_fn))
        p = run.plan
        print(
            f"{case.name:34s} pool rows {pool_row_bytes(run.args) / 2**20:6.1f} MiB grid {p.grid} segments {p.segments:4d} "
            f"own {own:.3f} ms, shared prefix {shared:.3f} ({shared / own:.2f}x), 2 x half {halves:.3f} ({halves / own:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
