"""Launch the kernel on one bench case a few times, for Nsight Compute to profile (one device call).

Usage: ncu --clock-control none -k verify_mla_fwd --launch-skip 3 --launch-count 1 --section ... \\
           python3 tools/profile_case.py "dsv3" [--target sm_120] [--define VMLA_SKIP_SOFTMAX=1]
(tools/ncu_stalls.sh wraps this: stall reasons, pipe and shared-memory use per case.)
"""

import argparse

import torch

from kdtree import bench  # noqa: E402
from kdtree.kernel import KernelConfig, VerifyKernel, choose_plan, device_arch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", help="substring of a bench case name")
    ap.add_argument("--target", default=None, help="run this target's configuration (default: this GPU's)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel (repeatable)")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument(
        "--candidates",
        action="store_true",
        help="the target's candidates, one picked for the batch (as kdtree bench runs; --define applies to each)",
    )
    ap.add_argument("--rows64", action="store_true", help="KernelConfig.rows64_in_registers (64 rows, Q in registers)")
    ap.add_argument("--no-l2", action="store_true", help="plan as if the GPU's L2 size were unknown (choose_plan's l2_bytes)")
    a = ap.parse_args()
    case = next(c for c in bench.BENCH_CASES if a.case in c.name)
    arch = a.target or device_arch()
    configs = KernelConfig.candidates(arch) if a.candidates else (KernelConfig.for_arch(arch),)
    if a.rows64:
        configs = (KernelConfig.rows64_in_registers(),)
    kern = VerifyKernel.get(tuple(c.with_defines(a.define) for c in configs))

    def unknown_l2(args, num_heads):  # VerifyKernel.plan without the GPU's L2 size
        p = choose_plan(args, num_heads, kern.num_sms, kern.configs)
        kern.compiled(p.config)
        return p

    run = bench.case_launch(case, unknown_l2 if a.no_l2 else kern.plan)
    for _ in range(a.launches):
        run.launch(kern)
    torch.cuda.synchronize()
    p = run.plan
    print(f"{case.name}: config {p.config}, grid {p.grid}, units {p.units}, segments {p.segments}")


if __name__ == "__main__":
    main()
