"""Where a plan's pool rows would come from: an LRU model of the L2 cache over the rows the kernel reads, in the
order its blocks run their segments (`LaunchPlan.walk`), for bench cases, with each block's segments in the
kernel's order and in unit order (VMLA_LAST_SEGMENT_FIRST=0). No GPU: a prediction to check against Nsight
Compute (tools/ncu_l2.sh), not a measurement.

The model: every block takes one key tile (BN rows) a step and pays `--segment-steps` steps at the start of each
segment; the blocks' reads of one step are interleaved; the cache holds `--l2-mib` of 1,152-byte rows, least
recently used out first. On kimi-tp8 8k x8 in unit order it gives 458 MB from DRAM, where Nsight measured 464.

Usage: python3 experiments/l2_model.py [--cases substring ...] [--target sm_90|sm_120] [--l2-mib 60]
"""

import argparse
import collections

from kdtree import bench
from kdtree.kernel import KernelConfig, choose_plan
from kdtree.kernel.config import POOL_ROW_BYTES
from kdtree.kernel.planner import SEGMENT_OVERHEAD_UNITS, LaunchPlan, pool_row_bytes
from kdtree.marshal import VerifyArgs, marshal
from kdtree.synth import synthesize


def row_reads(p: LaunchPlan, args: VerifyArgs, segment_steps: float):
    """Slot ids of every key tile the blocks read, in time order (a block's tiles one a step after its segment's
    start-up), as arrays."""
    a = {k: v.cpu().numpy() for k, v in p.arrays.items()}
    slots, indptr, bn = args.combined_kv_indices.numpy(), args.combined_kv_indptr.numpy(), p.config.bn
    clock = collections.defaultdict(float)
    events = []
    for c, rt, k0, k1, _ in p.walk():
        clock[c] += segment_steps
        b = a["rt_request"][rt]
        base, n = indptr[b], indptr[b + 1] - indptr[b]
        for k in range(k0, k1):
            if k * bn < n:
                events.append((clock[c], c, base + k * bn, base + min(n, (k + 1) * bn)))
            clock[c] += 1
    for _, _, lo, hi in sorted(events):
        yield slots[lo:hi]


def dram_rows(p: LaunchPlan, args: VerifyArgs, l2_rows: int, segment_steps: float) -> tuple[int, int]:
    """(rows read, rows missed) through an LRU cache of l2_rows rows."""
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    reads = misses = 0
    for tile in row_reads(p, args, segment_steps):
        for s in tile.tolist():
            reads += 1
            if s in lru:
                lru.move_to_end(s)
            else:
                misses += 1
                lru[s] = None
                if len(lru) > l2_rows:
                    lru.popitem(last=False)
    return reads, misses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["8k x8", "mixed", "32k x2"])
    ap.add_argument("--target", default="sm_90", help="plan with this target's candidates (choose_plan)")
    ap.add_argument("--l2-mib", type=float, default=60.0)
    ap.add_argument("--num-sms", type=int, default=132)
    ap.add_argument("--segment-steps", type=float, default=SEGMENT_OVERHEAD_UNITS)
    a = ap.parse_args()
    l2_bytes = int(a.l2_mib * 2**20)
    for case in bench.select_cases(a.cases):
        cap = synthesize(case.spec(), reference=False)
        args, H = marshal(cap), cap.meta.num_heads
        print(f"{case.name}: pool rows {pool_row_bytes(args) / 2**20:.1f} MiB")
        candidates = KernelConfig.candidates(a.target)
        for order, configs in (("last segment first", candidates), ("unit order", tuple(c.in_unit_order() for c in candidates))):
            p = choose_plan(args, H, a.num_sms, configs, l2_bytes=l2_bytes)
            reads, misses = dram_rows(p, args, l2_bytes // POOL_ROW_BYTES, a.segment_steps)
            print(
                f"   {order:18s} {p.config.body} grid {p.grid} segments "
                f"{p.segments}: L2 hits {1 - misses / reads:.0%}, DRAM {misses * POOL_ROW_BYTES / 1e6:,.0f} MB"
            )


if __name__ == "__main__":
    main()
