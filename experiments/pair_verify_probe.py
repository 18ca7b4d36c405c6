"""A producer/consumer pair of CTAs for the mma.sync path (`experiments/kernels/pair_verify_probe.cu`), timed against the
sm_120 configuration of the verify kernel and the raw mma.sync rate in the same run. The probe runs one 64-row
tile a cluster of 2 (66 clusters on the H200) over `--keys` keys of one of `--requests` requests (the clusters'
tiles share their requests' pool rows, as a request's row tiles do), no mask; its output is checked against
torch for a few clusters. Prints TFLOP/s and the fraction of the raw mma.sync rate; writes
pair_verify_probe.json to $OUT. One device call.

With --parts it also times the probe's timing builds (`PROBE_ROLE_ONLY`, `PROBE_SKIP_LOAD`: each role alone, with
and without its loads; their output is wrong by design).

Usage: python3 experiments/pair_verify_probe.py [--keys 8192] [--requests 4] [--cases "8k x4" "8k x8"] [--parts]
"""

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("KDTREE_KERNEL_TARGET", "sm_120")  # the verify kernel's sm_120 configuration, the baseline

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kdtree import bench  # noqa: E402
from kdtree.ceilings import cupy_module, mma_sync_ceilings, torch_stream  # noqa: E402
from kdtree.kernel import VerifyKernel  # noqa: E402

SOURCE = Path(__file__).parent / "kernels" / "pair_verify_probe.cu"
ROWS, DIM, VDIM = 64, 576, 512
PARTS = {  # name -> -D switches of a timing build
    "producer alone": ("-DPROBE_ROLE_ONLY=1",),
    "producer alone, no loads": ("-DPROBE_ROLE_ONLY=1", "-DPROBE_SKIP_LOAD=1"),
    "consumer alone": ("-DPROBE_ROLE_ONLY=2",),
    "consumer alone, no loads": ("-DPROBE_ROLE_ONLY=2", "-DPROBE_SKIP_LOAD=1"),
    "both, no loads": ("-DPROBE_SKIP_LOAD=1",),
    "producer on all dims": ("-DPROBE_DSPLIT=1",),
    "producer on all dims, alone": ("-DPROBE_DSPLIT=1", "-DPROBE_ROLE_ONLY=1"),
    "16-key tiles, 4 stages": ("-DPROBE_DSPLIT=1", "-DPROBE_BN=16", "-DPROBE_STAGES=4"),
    "16-key tiles, 4 stages, producer alone": ("-DPROBE_DSPLIT=1", "-DPROBE_BN=16", "-DPROBE_STAGES=4", "-DPROBE_ROLE_ONLY=1"),
    "16-key tiles, 4 stages, consumer alone": ("-DPROBE_DSPLIT=1", "-DPROBE_BN=16", "-DPROBE_STAGES=4", "-DPROBE_ROLE_ONLY=2"),
    "16-key tiles, 5 stages": ("-DPROBE_DSPLIT=1", "-DPROBE_BN=16", "-DPROBE_STAGES=5", "-DPROBE_OVER_LIMIT=1"),
    "ping-pong producer": ("-DPROBE_PINGPONG=1",),
    "ping-pong producer alone": ("-DPROBE_PINGPONG=1", "-DPROBE_ROLE_ONLY=1"),
    "ping-pong producer alone, no loads": ("-DPROBE_PINGPONG=1", "-DPROBE_ROLE_ONLY=1", "-DPROBE_SKIP_LOAD=1"),
    "ping-pong, no loads": ("-DPROBE_PINGPONG=1", "-DPROBE_SKIP_LOAD=1"),
    "ping-pong, 4 P stages": ("-DPROBE_PINGPONG=1", "-DPROBE_PSTAGES=4"),
    "ping-pong, 4 P stages, no loads": ("-DPROBE_PINGPONG=1", "-DPROBE_PSTAGES=4", "-DPROBE_SKIP_LOAD=1"),
    "scorer on all dims, 4 P stages": ("-DPROBE_DSPLIT=1", "-DPROBE_PSTAGES=4"),
    "ping-pong, V forwarded": ("-DPROBE_PINGPONG=1", "-DPROBE_FWD_V=1"),
    "ping-pong, V forwarded, producer alone": ("-DPROBE_PINGPONG=1", "-DPROBE_FWD_V=1", "-DPROBE_ROLE_ONLY=1"),
}


def reference(q, pool, slots, scale):
    """fp32 softmax(q k^T scale) v of one cluster's tile: [64, 512]."""
    kv = pool[slots.long()].float()
    p = torch.softmax(q.float() @ kv.T * scale, dim=-1)
    return p @ kv[:, :VDIM]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--cases", nargs="*", default=["8k x4", "8k x8", "32k x4"])
    ap.add_argument("--parts", action="store_true")
    a = ap.parse_args()
    if a.keys % 32:
        raise SystemExit(f"--keys must be a multiple of 32, got {a.keys}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = sms // 2
    stream = torch_stream()

    def build(defines=()):
        module = cupy_module(SOURCE, *defines)
        size = torch.zeros(1, dtype=torch.int32, device="cuda")
        with stream:
            module.get_function("pair_verify_smem_bytes")((1, 1, 1), (1, 1, 1), (np.uint64(size.data_ptr()),))
        torch.cuda.synchronize()
        fn = module.get_function("pair_verify")
        fn.max_dynamic_shared_size_bytes = int(size.item())
        return fn, int(size.item())

    fn, smem = build()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = (torch.randn(a.requests * a.keys, DIM, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(a.requests * a.keys, device="cuda", generator=gen).to(torch.int32).view(a.requests, a.keys)
    slots = perm[torch.arange(clusters, device="cuda") % a.requests].contiguous()
    q = (torch.randn(clusters, ROWS, DIM, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    out = torch.empty(clusters, ROWS, VDIM, device="cuda")
    scale = 1 / math.sqrt(192)  # DeepSeek-V3's softmax scale (qk_nope + qk_rope head dims)
    args = (
        np.uint64(q.data_ptr()),
        np.uint64(pool.data_ptr()),
        np.uint64(slots.data_ptr()),
        np.int32(a.keys),
        np.float32(scale * math.log2(math.e)),
        np.uint64(out.data_ptr()),
    )

    def launch(fn=fn, smem=smem):
        with stream:
            fn((2 * clusters, 1, 1), (256, 1, 1), args, shared_mem=smem)

    launch()
    torch.cuda.synchronize()
    refs = {c: reference(q[c], pool, slots[c], scale) for c in (0, 1, clusters - 1)}

    def worst_rel():
        return max(((out[c] - ref).abs().max() / ref.abs().max()).item() for c, ref in refs.items())

    rel = worst_rel()
    ms = bench.median_ms(launch)
    flops = clusters * ROWS * a.keys * (DIM + VDIM) * 2
    ceil = mma_sync_ceilings(bench.median_ms)
    raw = ceil["mma_sync_raw_tflops"]
    probe = dict(ms=ms, tflops=flops / ms / 1e9, smem=smem, rel_vs_torch=rel, clusters=clusters, keys=a.keys)
    print(f"mma.sync raw {raw:.0f} TFLOP/s, ldmatrix-fed {ceil['mma_sync_ldmatrix_tflops']:.0f}")
    print(
        f"pair probe: {clusters} clusters x 64 rows x {a.keys} keys ({a.requests} requests): {ms:.3f} ms, "
        f"{probe['tflops']:.0f} TFLOP/s = {probe['tflops'] / raw:.0%} of raw mma.sync; smem {smem} B; rel vs torch {rel:.1e}"
    )
    parts = {}
    for name, defines in PARTS.items() if a.parts else ():
        part, part_smem = build(defines)
        out.fill_(float("nan"))  # a build that writes nothing cannot pass on the one before's output
        launch(part, part_smem)
        torch.cuda.synchronize()
        checked = not any("ROLE_ONLY" in d or "SKIP" in d for d in defines)  # a build whose output is meant to be right
        part_rel = worst_rel() if checked else None
        parts[name] = dict(
            ms=bench.median_ms(lambda part=part, part_smem=part_smem: launch(part, part_smem)),
            rel_vs_torch=part_rel,
            smem=part_smem,
        )
        print(
            f"  {name:40s} {parts[name]['ms']:.3f} ms ({parts[name]['ms'] / ms:.2f}x the probe), smem {part_smem} B"
            + (f", rel vs torch {part_rel:.1e}" if checked else "")
        )
    kern = VerifyKernel.get()
    cases = []
    for case in bench.select_cases(a.cases, probes=True):
        run = bench.case_launch(case, kern.plan)
        cms = bench.median_ms(lambda run=run: run.launch(kern))
        tf = bench.case_flops(run.cap) / cms / 1e9
        cases.append(dict(name=case.name, ms=cms, tflops=tf))
        print(f"sm_120 configuration, {case.name}: {cms:.3f} ms, {tf:.0f} TFLOP/s = {tf / raw:.0%} of raw mma.sync")
    path = Path(os.environ.get("OUT", "."), "pair_verify_probe.json")
    path.write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(), ceilings=ceil, probe=probe, parts=parts, cases=cases), indent=1)
    )


if __name__ == "__main__":
    main()
