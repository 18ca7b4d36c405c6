"""What the split tiles' merge costs: the launch (forward kernel + verify_mla_merge) against the forward kernel
alone (timing only: without the merge the split rows are left unwritten), and a one-op launch for the timer's floor.

Usage: python3 experiments/merge_cost.py [case substring ...]   (needs a GPU; prints one line per case)
"""

import dataclasses
import sys

import torch
import triton.testing

from kdtree import bench  # noqa: E402
from kdtree.kernel import VerifyKernel, Workspace  # noqa: E402
from kdtree.marshal import marshal  # noqa: E402
from kdtree.synth import synthesize  # noqa: E402


def main():
    kern = VerifyKernel.get()
    patterns = sys.argv[1:] or ["small tree", "4k", "8k x8", "128k", "dsv3", "kimi-dp", "mixed"]
    for case in bench.select_cases(patterns, probes=True):
        cap = synthesize(case.spec(), reference=False)
        args = marshal(cap)
        dev = args.to("cuda")
        sets = bench.rotations(cap, 2)
        T, H = cap.num_tokens, cap.meta.num_heads
        o = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(T, H, device="cuda")
        p = kern.plan(args, H).to("cuda")
        ws = Workspace.for_plan(p)
        us = {}
        for name, pp in (("full", p), ("fwd_only", dataclasses.replace(p, segments=0))):
            fn = bench.cycling(sets, lambda q, pool, pp=pp: kern.launch(pp, dev, q, pool, o, lse, ws))
            fn()
            torch.cuda.synchronize()
            us[name] = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        z = torch.empty(1, device="cuda")
        us["one_op"] = 1e3 * triton.testing.do_bench(lambda: z.add_(1), warmup=25, rep=100, return_mode="median")
        print(
            f"{case.name}: "
            + ", ".join(f"{k} {v:.1f} us" for k, v in us.items())
            + f"; merge {us['full'] - us['fwd_only']:.1f} us; {p.segments} partials, {p.total_rows} rows",
            flush=True,
        )


if __name__ == "__main__":
    main()
