"""Launch the kernel on one bench case a few times, for Nsight Compute to profile (one device call).

Usage: ncu --clock-control none -k verify_mla_fwd --launch-skip 3 --launch-count 1 --section ... \\
           python3 scripts/profile_case.py "dsv3" [--target sm_120] [--define VMLA_SKIP_SOFTMAX=1]
(scripts/ncu_stalls.sh wraps this: stall reasons, pipe and shared-memory use per case.)
"""

import argparse
import dataclasses

import torch

from kdtree import bench  # noqa: E402
from kdtree.kernel import KernelConfig, VerifyKernel, Workspace, device_arch  # noqa: E402
from kdtree.marshal import marshal  # noqa: E402
from kdtree.synth import synthesize  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", help="substring of a bench case name")
    ap.add_argument("--target", default=None, help="run this target's configuration (default: this GPU's)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel (repeatable)")
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args()
    case = next(c for c in bench.ALL_CASES if a.case in c.name)
    config = KernelConfig.for_arch(a.target or device_arch())
    if a.define:
        config = dataclasses.replace(config, extra=tuple((k, int(v)) for k, v in (d.split("=") for d in a.define)))
    cap = synthesize(case.spec(), reference=False)
    args = marshal(cap)
    kern = VerifyKernel.get(config)
    p = kern.plan(args, cap.meta.num_heads).to("cuda")
    ws = Workspace.for_plan(p)
    q, pool = cap.layer(0).q.cuda(), cap.pool(0, "cuda")
    o = torch.empty(cap.num_tokens, cap.meta.num_heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(cap.num_tokens, cap.meta.num_heads, device="cuda")
    dev = args.to("cuda")
    for _ in range(a.launches):
        kern.launch(p, dev, q, pool, o, lse, ws)
    torch.cuda.synchronize()
    print(f"{case.name}: config {config}, grid {p.grid}, units {p.units}, segments {p.segments}")


if __name__ == "__main__":
    main()
