"""Pool-row gathers shared by the two CTAs of a cluster (`experiments/kernels/gather_pair_probe.cu`) against each CTA
gathering its own (`kernels/gather_ceiling.cu`'s cp.async gather, the kernel's pattern, and the same with bulk
copies), same run, same slot ids, from a pool that fits in L2 and from one that does not. Prints, per mode and
stage count, the bytes landed in shared memory a second (every CTA's tiles, so a pair's two copies count twice)
and the bytes read from global memory a second; checks every thread's XOR of the words it saw against the host's.
Writes gather_pair_probe.json to $OUT. One device call (sm_90: the cluster modes need clusters; the multicast
mode is sm_90a's).

Usage: python3 experiments/gather_pair_probe.py [--tiles 1024]
"""

import argparse
import json
import os
from pathlib import Path

import cupy
import numpy as np
import torch
import triton.testing

from kdtree.ceilings import GATHER_SOURCE, cupy_module, torch_stream
from kdtree.kernel.config import POOL_ROW_BYTES
from kdtree.kernel.launch import sm90a_module

SOURCE = Path(__file__).parent / "kernels" / "gather_pair_probe.cu"
ROWS, WORDS = 32, POOL_ROW_BYTES // 4
POOLS = {"l2": 1 << 13, "hbm": 1 << 22}  # pool rows: 9.4 MB (L2-resident), 4.8 GB
MODES = {  # name -> (entry, threads, CTAs that read each tile's rows together)
    "cp.async (kernel)": ("gather_{s}", 256, 1),
    "bulk": ("gather_bulk_{s}", 320, 1),
    "pair, forward": ("gather_pair_fwd_{s}", 320, 2),
    "pair, multicast": ("gather_pair_mc_{s}", 320, 2),
    "pair, cp.async+fwd": ("gather_pair_cp_{s}", 320, 2),
}


def expected_xor(pool_words, slots, sms, pair, tiles):
    """What each waiting thread (row r = t / 8, word j = t % 8) XORs over its CTA's tiles: [ctas, 256]."""
    groups = sms // pair
    idx = (
        torch.arange(groups, device="cuda")[:, None, None] * tiles * ROWS
        + torch.arange(tiles, device="cuda")[None, :, None] * ROWS
        + torch.arange(ROWS, device="cuda")[None, None, :]
    ) & (slots.numel() - 1)
    words = pool_words[:, :8][slots[idx].long()]  # [groups, tiles, 32 rows, 8 words]
    x = words[:, 0].clone()
    for t in range(1, tiles):
        x ^= words[:, t]
    return x.reshape(groups, 256).repeat_interleave(pair, dim=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=1024)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count // 2 * 2
    stream = torch_stream()
    opts = ("-std=c++17", f"-I{SOURCE.parent}")
    probe = sm90a_module(cupy, SOURCE, opts, "gather_bulk_2")
    ceiling = cupy_module(GATHER_SOURCE)
    out = torch.empty(sms * 256, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(sms * 2, dtype=torch.int64, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for pool_name, pool_rows in POOLS.items():
        pool_words = torch.randint(-(1 << 31), 1 << 31, (pool_rows, WORDS), dtype=torch.int32, device="cuda", generator=gen)
        slots = torch.randint(0, pool_rows, (1 << 22,), dtype=torch.int32, device="cuda", generator=gen)
        want = {p: expected_xor(pool_words, slots, sms, p, a.tiles) for p in (1, 2)}
        for stages in (2, 4):
            for mode, (entry, threads, pair) in MODES.items():
                module = ceiling if mode.startswith("cp.async") else probe
                fn = module.get_function(entry.format(s=stages))
                fn.max_dynamic_shared_size_bytes = smem = stages * ROWS * POOL_ROW_BYTES
                args = (
                    np.uint64(pool_words.data_ptr()),
                    np.uint64(slots.data_ptr()),
                    np.int32(slots.numel() - 1),
                    np.int32(a.tiles),
                    np.uint64(out.data_ptr()),
                )
                if module is probe:
                    args += (np.uint64(stamps.data_ptr()),)

                def launch(fn=fn, args=args, threads=threads, smem=smem):
                    with stream:
                        fn((sms, 1, 1), (threads, 1, 1), args, shared_mem=smem)

                out.zero_()
                launch()
                torch.cuda.synchronize()
                ok = bool((out.view(sms, 256) == want[pair]).all())
                ms = triton.testing.do_bench(launch, warmup=5, rep=50)
                landed = sms * a.tiles * ROWS * POOL_ROW_BYTES / ms / 1e9
                span = stamps.view(sms, 2).float()
                waves = "-" if module is ceiling else f"{(span[:, 0].max() - span[:, 0].min()).item() / 1e3:.1f} us"
                rows.append(
                    dict(pool=pool_name, stages=stages, mode=mode, ms=ms, landed_tbps=landed, read_tbps=landed / pair, correct=ok)
                )
                print(
                    f"{pool_name:3s} {stages} stages  {mode:18s} {ms:7.3f} ms  landed {landed:5.2f} TB/s  "
                    f"read {landed / pair:5.2f} TB/s  start spread {waves}  {'ok' if ok else 'WRONG BYTES'}"
                )
    path = Path(os.environ.get("OUT", "."), "gather_pair_probe.json")
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), sms=sms, tiles=a.tiles, rows=rows), indent=1))


if __name__ == "__main__":
    main()
