"""Ceilings of the present GPU measured with the package's own microkernels. The bf16 mma.sync rates
(`kernels/mma_ceiling.cu`): raw (operands in registers, 8 independent accumulators a warp by default) and ldmatrix-fed
(every MMA's operands through shared memory, as a real tile gets them); mma.sync is the only tensor-core path
of sm_120, so these, not the matmul rate, are its ceilings, and on Hopper they sit below wgmma's. The gather
rate (`kernels/gather_ceiling.cu`): pool rows by slot id into shared memory with 16-byte cp.async, one block
of 256 threads an SM, as the verify kernel loads its tiles, from a pool that fits in L2 and from one that does
not. Needs a GPU and CuPy."""

from __future__ import annotations

import numpy as np
import torch

from kdtree.kernel.config import KERNEL_DIR, POOL_ROW_BYTES

SOURCE = KERNEL_DIR / "mma_ceiling.cu"
GATHER_SOURCE = KERNEL_DIR / "gather_ceiling.cu"
KERNELS = {"mma_raw": 8, "mma_ldmatrix": 8}  # entry point: MMAs a warp issues per loop iteration (raw: its chains)
THREADS, BLOCKS_PER_SM, ITERS = 256, 4, 4096
FLOP_PER_MMA = 2 * 16 * 8 * 16  # m16n8k16
TILE_ROWS = 32  # pool rows a tile
# name -> (stages, pool rows); stages S runs entry point gather_S. 8,192 rows are 9.4 MB (L2-resident), 4M rows
# 4.8 GB (HBM)
GATHERS = {"gather_l2": (4, 1 << 13), "gather_l2_2stages": (2, 1 << 13), "gather_hbm": (4, 1 << 22)}
GATHER_TILES = 1024  # tiles a block gathers a launch (even; ~4.9 GB on 132 SMs: the pool's first touch is noise)


def cupy_module(source, *defines: str):
    """`source` (a kernels/ file) JIT-compiled by CuPy for this GPU, with the kernels' include path and `defines`."""
    import cupy

    return cupy.RawModule(code=source.read_text(), options=("-std=c++17", f"-I{KERNEL_DIR}", *defines))


def torch_stream():
    """torch's current stream as a CuPy stream, so the microkernels queue behind torch's work."""
    import cupy

    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def mma_sync_ceilings(do_bench, *defines: str, chains: int = KERNELS["mma_raw"], blocks_per_sm: int = BLOCKS_PER_SM) -> dict:
    """{"mma_sync_raw_tflops": ..., "mma_sync_ldmatrix_tflops": ...}, each from `do_bench`'s time of one launch; the
    microkernels built with `defines` ("-DNAME=VALUE"), the raw one on `chains` independent accumulators a warp,
    `blocks_per_sm` blocks of 8 warps an SM (1: as many warps as the verify kernel's). Each MMA the source names
    counts once (with VMLA_MMA_REPEAT=n the rates are those of a part with 1/n the tensor rate)."""
    module = cupy_module(SOURCE, *defines, f"-DVMLA_CEILING_CHAINS={chains}")
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    grid = sms * blocks_per_sm
    out = torch.empty(grid * THREADS, device="cuda")
    stream = torch_stream()
    result = {}
    for name, mmas in (KERNELS | {"mma_raw": chains}).items():
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


def gather_ceilings(do_bench) -> dict:
    """{"gather_l2_tbps": ..., "gather_l2_2stages_tbps": ..., "gather_hbm_tbps": ...}: bytes landed in shared
    memory a second, each from `do_bench`'s time of one launch (one block an SM)."""
    module, stream = cupy_module(GATHER_SOURCE), torch_stream()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = torch.empty(sms * THREADS, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {}
    for name, (stages, rows) in GATHERS.items():
        entry = f"gather_{stages}"
        fn = module.get_function(entry)
        fn.max_dynamic_shared_size_bytes = smem = stages * TILE_ROWS * POOL_ROW_BYTES
        pool = torch.ones(rows, POOL_ROW_BYTES // 2, dtype=torch.bfloat16, device="cuda")
        slots = torch.randint(0, rows, (1 << 22,), dtype=torch.int32, device="cuda", generator=gen)
        args = (np.uint64(pool.data_ptr()), np.uint64(slots.data_ptr()), np.int32(slots.numel() - 1))
        args += (np.int32(GATHER_TILES), np.uint64(out.data_ptr()))

        def launch(fn=fn, args=args, smem=smem):
            with stream:
                fn((sms, 1, 1), (THREADS, 1, 1), args, shared_mem=smem)

        launch()
        torch.cuda.synchronize()
        if bool(out.any()):  # each word a thread sees is the pool's (two bf16 ones): an even count XORs to 0
            raise RuntimeError(f"{entry} saw other bytes than the pool's: {out.unique().tolist()[:4]}")
        result[f"{name}_tbps"] = sms * GATHER_TILES * TILE_ROWS * POOL_ROW_BYTES / do_bench(launch) / 1e9
        del pool, slots
    return result
