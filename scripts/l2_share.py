"""How much of a case's time is its pool rows missing L2: each case as `kdtree bench` plans it, timed against the
same launch with every request's prefix keys pointed at the longest request's pool rows (the same rows read in the
same order, but one request's prefix to hold in L2 instead of all of them; the output is wrong, the work is not).

Usage: python3 scripts/l2_share.py [--cases substring ...]   (needs a GPU; one line a case)
"""

import argparse
import dataclasses

import triton.testing

from kdtree import bench
from kdtree.kernel import VerifyKernel
from kdtree.kernel.planner import pool_row_bytes
from kdtree.marshal import marshal
from kdtree.synth import synthesize


def shared_prefix(args):
    """`args` with each request's prefix slots replaced by the longest request's first ones."""
    idx, ptr, pre = args.combined_kv_indices.clone(), args.combined_kv_indptr.tolist(), args.prefix_lens.tolist()
    big = max(range(len(pre)), key=pre.__getitem__)
    src = idx[ptr[big] : ptr[big] + pre[big]].clone()
    for r, n in enumerate(pre):
        idx[ptr[r] : ptr[r] + n] = src[:n]
    return dataclasses.replace(args, combined_kv_indices=idx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["8k x8", "mixed", "32k x2", "32k x4", "128k", "8k x4"])
    a = ap.parse_args()
    kern = VerifyKernel.get()
    print(f"L2 {kern.l2_bytes / 2**20:.0f} MiB")
    for case in bench.select_cases(a.cases, probes=True):
        cap = synthesize(case.spec(), reference=False)
        args = marshal(cap)
        p = kern.plan(args, cap.meta.num_heads).to("cuda")
        q, pool = cap.layer(0).q.cuda(), cap.pool(0, "cuda")
        o, lse, ws = bench.launch_outputs(cap, p)
        ms = {}
        for name, x in (("own rows", args), ("shared prefix", shared_prefix(args))):
            dev = x.to("cuda")
            ms[name] = triton.testing.do_bench(lambda dev=dev: kern.launch(p, dev, q, pool, o, lse, ws), warmup=25, rep=100)
        print(
            f"{case.name:34s} pool rows {pool_row_bytes(args) / 2**20:6.1f} MiB grid {p.grid} segments {p.segments:4d} "
            f"own {ms['own rows']:.3f} ms shared {ms['shared prefix']:.3f} ms ({ms['shared prefix'] / ms['own rows']:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
