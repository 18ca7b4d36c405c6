"""The bf16 mma.sync ceilings of the present GPU, measured with the package's own microkernels
(`kernels/mma_ceiling.cu`): the raw rate (operands in registers, 8 independent accumulators a warp) and the
ldmatrix-fed rate (every MMA's operands through shared memory, as a real tile gets them). mma.sync is the
only tensor-core path of sm_120, so these, not the matmul rate, are its ceilings; on Hopper they sit below
wgmma's. Needs a GPU and CuPy."""

from __future__ import annotations

import numpy as np
import torch

from kdtree.kernel.config import KERNEL_DIR

SOURCE = KERNEL_DIR / "mma_ceiling.cu"
KERNELS = {"mma_raw": 8, "mma_ldmatrix": 8}  # entry point: MMAs a warp issues per loop iteration
THREADS, BLOCKS_PER_SM, ITERS = 256, 4, 4096
FLOP_PER_MMA = 2 * 16 * 8 * 16  # m16n8k16


def mma_sync_ceilings(do_bench) -> dict:
    """{"mma_sync_raw_tflops": ..., "mma_sync_ldmatrix_tflops": ...}, each from `do_bench`'s time of one launch."""
    import cupy

    module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17", f"-I{KERNEL_DIR}"))
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    grid = sms * BLOCKS_PER_SM
    out = torch.empty(grid * THREADS, device="cuda")
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    result = {}
    for name, mmas in KERNELS.items():
        fn = module.get_function(name)

        def launch(fn=fn):
            with stream:
                fn((grid, 1, 1), (THREADS, 1, 1), (np.uint64(out.data_ptr()), np.int32(ITERS)))

        launch()
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise RuntimeError(f"{name} wrote non-finite sums")
        flops = grid * (THREADS // 32) * ITERS * mmas * FLOP_PER_MMA
        result[f"mma_sync_{name.removeprefix('mma_')}_tflops"] = flops / do_bench(launch) / 1e9
    return result
