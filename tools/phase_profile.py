"""Where a 64-key step of the Hopper split_keys loop spends its cycles, phase by phase: the kernel built with
VMLA_PHASES (kernels/verify_mla_hooks.cuh) has thread 0 of each warpgroup add clock64 deltas per phase; this
prints cycles a step for each phase and warpgroup (summed over all blocks and steps of --reps launches, divided by
the steps). The hook's clock reads slow the kernel (its launch time is printed beside the phases), so compare
profiles with each other, not with the bench. One device call (Hopper); writes phase_profile.json to $OUT.

Usage: python3 tools/phase_profile.py "32k x8" "dsv3-tp8 ddtree64 8k" [--reps 5] [--define NAME=VALUE ...]
(Bench cases match by substring; few-row tiles are not counted: they run their own segment.)
"""

import argparse
import json
import os
from pathlib import Path

import torch

from kdtree import bench
from kdtree.kernel import KernelConfig, VerifyKernel, device_arch, plan

PHASES = (
    "top: tiles landed, barrier",
    "QK and next tiles issued",
    "QK wait",
    "row maxima",
    "maxima trade barrier",
    "exp, P, own P V issued",
    "P trade barrier",
    "other P V issued, waited",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE for the kernel (repeatable)")
    a = ap.parse_args()
    if device_arch() != "sm_90":
        raise SystemExit(f"the split_keys loop is the Hopper body's (sm_90); this GPU is {device_arch()}")
    config = KernelConfig.for_arch("sm_90a").with_defines([*a.define, "VMLA_PHASES=1"])
    kern = VerifyKernel.get(config)
    counters = kern.cupy.ndarray((2, 9), dtype=kern.cupy.uint64, memptr=kern.module.get_global("vmla_phases"))
    results = {}
    for case in bench.select_cases(a.cases):
        run = bench.case_launch(case, lambda args, H: plan(args, H, kern.num_sms, config))
        run.launch(kern)  # warm-up
        torch.cuda.synchronize()
        counters.fill(0)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(a.reps):
            run.launch(kern)
        ev[1].record()
        torch.cuda.synchronize()
        c = counters.get()
        if int(c[0][8]) == 0:
            print(f"{case.name}: no 64-row steps (every row tile is a few-row one)")
            continue
        per_step = [[float(c[w][k]) / int(c[w][8]) for k in range(8)] for w in range(2)]
        results[case.name] = {
            "ms_per_launch": ev[0].elapsed_time(ev[1]) / a.reps,
            "steps": [int(c[w][8]) // a.reps for w in range(2)],
            "cycles_per_step": {name: [per_step[0][k], per_step[1][k]] for k, name in enumerate(PHASES)},
        }
        r = results[case.name]
        print(f"{case.name}: {r['ms_per_launch']:.3f} ms a launch, {r['steps'][0]} steps a launch (64 keys each)")
        for k, name in enumerate(PHASES):
            print(f"   {k} {name:28s} wg0 {per_step[0][k]:7.0f}  wg1 {per_step[1][k]:7.0f}")
        print(f"     {'step':28s} wg0 {sum(per_step[0]):7.0f}  wg1 {sum(per_step[1]):7.0f}")
    Path(os.environ.get("OUT", "."), "phase_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
