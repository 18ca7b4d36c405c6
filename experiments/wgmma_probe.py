"""The rate of the Hopper body's QK shape on the present GPU (`experiments/kernels/wgmma_probe.cu`): chains of 36 wgmma
m64nNk16 (576 dims), N 32 (the kernel's tiles) or 64, A (Q) from shared memory or registers, B (K) from shared
memory, issued by one warpgroup of a block or by both at once, one block an SM. Prints cycles a chain, cycles a
wgmma (a warpgroup's, and the SM's with both issuing) and FLOP a cycle per SM against the 4,096 of the tensor
cores' dense bf16 peak; writes wgmma_probe.json to $OUT. One device call (Hopper).

Usage: python3 experiments/wgmma_probe.py [--chains 2000]
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import cupy
import numpy as np
import torch

from kdtree.kernel import device_arch
from kdtree.kernel.launch import sm90a_module

SOURCE = Path(__file__).parent / "kernels" / "wgmma_probe.cu"
PEAK = 4096  # dense bf16 FLOP a cycle per SM (1,024 FMA)
ONE_BLOCK_PER_SM = 116 * 1024  # shared memory a block asks for at least, so no two blocks share an SM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=2000)
    a = ap.parse_args()
    if device_arch() != "sm_90":
        raise SystemExit(f"wgmma is Hopper's (sm_90); this GPU is {device_arch()}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    out = torch.empty(sms * 256, device="cuda")
    clocks = torch.zeros(sms * 2, dtype=torch.int64, device="cuda")
    rows = []
    for n in (32, 64):
        for a_smem in (1, 0):
            mod = sm90a_module(
                cupy, SOURCE, ("-std=c++17", f"-I{SOURCE.parent}", f"-DPROBE_N={n}", f"-DPROBE_A_SMEM={a_smem}"), "wgmma_qk_probe"
            )
            fn = mod.get_function("wgmma_qk_probe")
            smem = max(9 * (64 + n) * 64 * 2, ONE_BLOCK_PER_SM)
            fn.max_dynamic_shared_size_bytes = smem
            for wgs in (1, 2):
                for _ in range(2):  # the first launch warms the clocks up
                    clocks.zero_()
                    with stream:
                        fn(
                            (sms, 1, 1),
                            (256, 1, 1),
                            (np.uint64(out.data_ptr()), np.uint64(clocks.data_ptr()), np.int32(a.chains), np.int32(wgs)),
                            shared_mem=smem,
                        )
                    torch.cuda.synchronize()
                if not torch.isfinite(out.view(sms, 256)[:, : 128 * wgs]).all():
                    raise RuntimeError(f"N {n} A_smem {a_smem} warpgroups {wgs}: non-finite sums")
                per_chain = statistics.median(clocks.view(sms, 2)[:, :wgs].flatten().tolist()) / a.chains
                flop_per_cycle = wgs * 36 * 2 * 64 * n * 16 / per_chain
                rows.append(
                    dict(
                        n=n,
                        a="smem" if a_smem else "regs",
                        warpgroups=wgs,
                        cycles_per_chain=per_chain,
                        cycles_per_wgmma=per_chain / 36,  # a warpgroup's
                        sm_cycles_per_wgmma=per_chain / (36 * wgs),  # the SM's, all warpgroups together
                        flop_per_cycle=flop_per_cycle,
                        of_peak=flop_per_cycle / PEAK,
                    )
                )
                r = rows[-1]
                print(
                    f"m64n{n}k16 A {r['a']:4s} {wgs} warpgroup(s): {per_chain:7.0f} cycles a chain, "
                    f"{r['cycles_per_wgmma']:5.1f} a wgmma a warpgroup ({r['sm_cycles_per_wgmma']:5.1f} the SM's), "
                    f"{flop_per_cycle:5.0f} FLOP/cycle/SM = {r['of_peak']:.0%} of peak"
                )
    path = Path(os.environ.get("OUT", "."), "wgmma_probe.json")
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), chains=a.chains, rows=rows), indent=1))


if __name__ == "__main__":
    main()
