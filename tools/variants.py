"""Time kernel variants side by side (one device call): configurations and the VMLA_SKIP_* experiments.

Usage: python3 tools/variants.py [--cases substring ...] [--variants name ...] [--mma-repeat 1 2] [--mma-ceilings]
(needs a GPU; prints a table, writes {"mma_ceilings": ..., "cases": {case: {build: ...}}} to --json or
$OUT/variants.json)
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from kdtree import bench  # noqa: E402
from kdtree.ceilings import BLOCKS_PER_SM, mma_sync_ceilings  # noqa: E402
from kdtree.kernel import MERGE_THREADS, KernelConfig, VerifyKernel, Workspace, pdl_available, plan  # noqa: E402
from kdtree.marshal import marshal  # noqa: E402
from kdtree.synth import synthesize  # noqa: E402

BM64 = dict(bm=64, q_smem=True, rgroups=2, khalves=1)
BLOCKS64 = KernelConfig.for_arch("sm_90a-blocks64")  # the blocks64 body alone (no few-row tiles beside it)
# VMLA_SKIP_* sets: variant suffix -> the parts left out (the wgmma body also has the partial-score exchange)
SKIPS = {
    "qk": ["QK"],
    "pv": ["PV"],
    "mma": ["QK", "PV"],
    "softmax": ["SOFTMAX"],
    "load": ["LOAD"],
    "all": ["QK", "PV", "SOFTMAX", "LOAD"],
}
WGMMA_SKIPS = SKIPS | {"exchange": ["EXCHANGE"], "load_mma": ["LOAD", "QK", "PV"], "all": SKIPS["all"] + ["EXCHANGE"]}


def each_with(configs: tuple[KernelConfig, ...], *defines: str) -> tuple[KernelConfig, ...]:
    """Every one of `configs` built with `defines` ("NAME=VALUE")."""
    return tuple(c.with_defines(defines) for c in configs)


# name -> (configuration, or the candidates the cost model picks from per batch ("_choose"), plan options)
VARIANTS = {
    # what `kdtree bench` runs: the Hopper candidates and the sm_120 configuration, planned by choose_plan; and the
    # same kernels with each block's segments in unit order
    "hopper": (KernelConfig.candidates("sm_90"), {"_choose": True}),
    "hopper_in_order": (tuple(c.in_unit_order() for c in KernelConfig.candidates("sm_90")), {"_choose": True}),
    "sm120": ((KernelConfig(),), {"_choose": True}),
    "sm120_in_order": ((KernelConfig().in_unit_order(),), {"_choose": True}),
    # the walk that holds only the next segment's tile and its range's end (VMLA_WALK_LEAN, the hooks' builds' walk)
    "hopper_lean": (each_with(KernelConfig.candidates("sm_90"), "VMLA_WALK_LEAN=1"), {"_choose": True}),
    "sm120_lean": (each_with((KernelConfig(),), "VMLA_WALK_LEAN=1"), {"_choose": True}),
    # the merge's rows of more than 8 partials loaded one partial at a time (VMLA_MERGE_STAGED=0)
    "hopper_merge_one_at_a_time": (each_with(KernelConfig.candidates("sm_90"), "VMLA_MERGE_STAGED=0"), {"_choose": True}),
    "sm120_merge_one_at_a_time": (each_with((KernelConfig(),), "VMLA_MERGE_STAGED=0"), {"_choose": True}),
    "bm32_regs": (KernelConfig(), {}),  # sm_120's configuration
    # ... with its 8 warps split otherwise in QK (rows x dim slices x keys; the default is 1 x 4 x 2), in sm_120's limits
    "bm32_r2d4k1": (KernelConfig(rgroups=2, khalves=1), {}),
    "bm32_r2d4k1_kp2": (KernelConfig(rgroups=2, khalves=1, kpasses=2), {}),
    "bm32_r2d2k2": (KernelConfig(rgroups=2, dslices=2, khalves=2), {}),
    # 64 rows with Q in registers in sm_120's limits (16-key tiles, 4 stages); a segment is twice as many units
    "bm64_regs": (KernelConfig.rows64_in_registers(), {"segment_units": 10.0}),
    "bm64_regs_seg5": (KernelConfig.rows64_in_registers(), {}),
    "bm64_r2k1": (KernelConfig(**BM64), {}),  # sm_90's configuration
    "bm64_16warps": (KernelConfig(**(BM64 | dict(warps=16, khalves=2))), {}),  # 128 registers each: spills
    # the tree mask read key by key (the bit-equality reference)
    "no_fast_mask": (KernelConfig(**BM64, extra=(("VMLA_FAST_MASK", 0),)), {}),
    # blocks64: FlashMLA's schedule on 64-key blocks (verify_segment_blocks64; no few-row tiles beside it)
    "blocks64": (BLOCKS64, {}),
    # ... with the row tiles of requests whose tiles are each worth >= n blocks' shares cut at common key offsets, so
    # that their blocks read each key together (plan(align_shares=n), aligned_split)
    **{f"blocks64_aligned{n}": (BLOCKS64, {"align_shares": float(n)}) for n in (3, 6)},
    **{f"blocks64_aligned6_seg{m}": (BLOCKS64, {"align_shares": 6.0, "segment_units": float(m)}) for m in (8, 10, 12)},
    # ... placed with a segment weighed n units (the cost model's segment is 10/9 / 0.82 = 1.35x a split_keys one in its
    # own units), a short row tile's SHORT_SEGMENT_UNITS more (plan's default)
    **{
        f"blocks64_seg{n}": (
            BLOCKS64,
            {"segment_units": float(n)},
        )
        for n in (6, 7, 8, 10, 12, 14, 20)
    },
    # ... and with a short row tile's segment (at most SHORT_TILE_UNITS units) weighed n units more than a segment
    # (default SHORT_SEGMENT_UNITS; 0: as any other)
    **{f"blocks64_short{n}": (BLOCKS64, {"short_segment_units": float(n)}) for n in (0, 4, 6, 8, 12)},
    **{
        f"blocks64_seg{n}_short{m}": (BLOCKS64, {"segment_units": float(n), "short_segment_units": float(m)})
        for n, m in ((6, 8), (7, 8))
    },
    **{f"wgmma_short{n}": (KernelConfig.for_arch("sm_90a"), {"short_segment_units": float(n)}) for n in (0, 4, 8)},
    "bm32_short0": (KernelConfig(), {"short_segment_units": 0.0}),
    # k whole row tiles a block (the grid cut to ceil(row tiles / k)) instead of the batch balanced over every block;
    # equal tiles (each over all its request's keys), which such a grid runs unsplit; beside the same over every block
    "blocks64_all_keys": (
        BLOCKS64,
        {"visible_keys": False},
    ),
    "blocks64_tile_a_block": (
        BLOCKS64,
        {"_tiles_a_block": 1, "visible_keys": False},
    ),
    "bm32_two_tiles_a_block": (KernelConfig(), {"_tiles_a_block": 2, "visible_keys": False}),
    # BM 32 in blocks of 4 warps, two resident per SM (independent barriers: one block's softmax under the other's MMAs)
    "bm32_w4x2": (KernelConfig(warps=4, khalves=1, kpasses=2, blocks_per_sm=2), {}),
    "bm32_w4x1": (KernelConfig(warps=4, khalves=1, kpasses=2), {}),
    # BM 32 with 64-key tiles (half the barriers and per-tile steps per key; sm_90's shared memory only)
    "bm32_bn64": (KernelConfig(bn=64, kpasses=2), {}),
    "bm32_bn64_k1": (KernelConfig(bn=64), {}),
    "bm32_bn64_qsmem": (KernelConfig(bn=64, kpasses=2, q_smem=True), {}),
    # deeper cp.async rings at BM 32 (sm_90's shared memory only): more time for cold (HBM) pool rows to land
    "bm32_s3": (KernelConfig(stages=3), {}),
    "bm32_s4": (KernelConfig(stages=4), {}),
    # the Hopper path: warpgroup MMAs from swizzled shared memory (sm_90a)
    "wgmma": (KernelConfig.for_arch("sm_90a"), {}),
    # the warpgroups splitting a 32-key tile's dims (partial scores exchanged), pipelined: dims_split, the body before split_keys
    "wgmma_dims_split": (KernelConfig.for_arch("sm_90a").dims_split(), {}),
    "wgmma_nopipe": (dataclasses.replace(KernelConfig.for_arch("sm_90a"), stages=2, wg_pipe=0, split_keys=False), {}),
    "wgmma_s3": (dataclasses.replace(KernelConfig.for_arch("sm_90a"), stages=3, wg_pipe=0, split_keys=False), {}),
    # the merge after a plain launch instead of as a programmatic dependent; 128 or 32 threads a merge row
    "wgmma_nopdl": (KernelConfig.for_arch("sm_90a"), {"_pdl": False}),
    "wgmma_merge128": (KernelConfig.for_arch("sm_90a"), {"_merge_threads": 128}),
    "wgmma_nopdl_merge128": (KernelConfig.for_arch("sm_90a"), {"_pdl": False, "_merge_threads": 128}),
    "wgmma_merge32": (
        dataclasses.replace(KernelConfig.for_arch("sm_90a"), extra=(("VMLA_MERGE_VECS", 4),)),
        {"_merge_threads": 32},
    ),
    # few-row tiles (<= 16 rows) as 64-row wgmma tiles instead of the mma.sync few-row segment; its plan weight
    "wgmma_nofew": (dataclasses.replace(KernelConfig.for_arch("sm_90a"), few_rows=0), {}),
    **{
        f"wgmma_few{round(c * 100)}": (KernelConfig.for_arch("sm_90a"), {"few_unit_cost": c})
        for c in (0.3, 0.5, 0.55, 0.6, 0.65, 0.7)
    },
    "wgmma_merge_kernel": (KernelConfig.for_arch("sm_90a"), {"fused_merge": False}),
    "wgmma_fused": (KernelConfig.for_arch("sm_90a"), {"fused_merge": True}),
    # every row tile over all its request's keys, not only up to the last one its rows may see
    "wgmma_all_keys": (KernelConfig.for_arch("sm_90a"), {"visible_keys": False}),
    "bm32_all_keys": (KernelConfig(), {"visible_keys": False}),
    # equal unit shares (session 4's plan) instead of shares balanced for segment overheads
    "wgmma_equal": (KernelConfig.for_arch("sm_90a"), {"segment_units": 0}),
    "bm32_equal": (KernelConfig(), {"segment_units": 0}),
    **{f"wgmma_seg{n}": (KernelConfig.for_arch("sm_90a"), {"segment_units": n}) for n in (2, 4, 5, 6, 8)},
    **{f"bm32_seg{n}": (KernelConfig(), {"segment_units": n}) for n in (2, 4, 6)},
    # the same kernel with parts of each tile's work left out (wrong output; where does the time go?)
    **{
        f"{name}_skip_{n}": (dataclasses.replace(config, extra=config.extra + tuple((f"VMLA_SKIP_{k}", 1) for k in ks)), {})
        for name, config, skips in (
            ("bm64", KernelConfig(**BM64), SKIPS),
            ("bm32", KernelConfig(), SKIPS),
            ("bm64_regs", KernelConfig.rows64_in_registers(), SKIPS),
            ("wgmma", KernelConfig.for_arch("sm_90a"), SKIPS | {"load_mma": ["LOAD", "QK", "PV"]}),
            ("blocks64", BLOCKS64, {"load": ["LOAD"]}),  # (its segment has only this hook)
            (
                "wgmma_dims_split",
                KernelConfig.for_arch("sm_90a").dims_split(),
                WGMMA_SKIPS,
            ),
        )
        for n, ks in skips.items()
    },
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["32k x4", "dsv3", "small tree", "8k x8", "mixed"])
    ap.add_argument("--repeat", type=int, default=1, help="time each variant this many times, interleaved (median)")
    ap.add_argument("--variants", nargs="*", default=["bm64_r2k1", "no_fast_mask", "bm32_regs", "bm32_w4x2"])
    ap.add_argument(
        "--mma-repeat",
        nargs="*",
        type=int,
        default=[1],
        help="time each mma.sync variant with every MMA issued n times (VMLA_MMA_REPEAT=n, named <variant>_mma_x<n>; "
        "wrong sums): the tensor rate per SM-cycle of a part with 1/n of this GPU's, as sm_120's mma.sync is half the "
        "H200's",
    )
    ap.add_argument(
        "--mma-ceilings",
        action="store_true",
        help="first measure the mma.sync ceilings at each --mma-repeat, the raw one on 2, 4 and 8 accumulators a warp, "
        "4 blocks of 8 warps an SM and 1",
    )
    ap.add_argument("--json", type=Path, help="where to write the results (default: $OUT/variants.json)")
    a = ap.parse_args()
    if not a.mma_repeat or min(a.mma_repeat) < 1:
        ap.error(f"--mma-repeat takes counts >= 1, got {a.mma_repeat}")
    a.mma_repeat = sorted(set(a.mma_repeat))
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}")
    return a


def expand_builds(variants: list[str], repeats: list[int]) -> list[tuple[str, object, dict, int]]:
    """(name, configuration(s), plan options, MMA repeat) of every build to time: each variant at each repeat. A
    repeat of n issues each mma.sync n times and leaves warpgroup MMAs as they are, so a variant with the wgmma body
    takes none."""
    builds = []
    for variant in variants:
        config, plan_opts = VARIANTS[variant]
        configs = config if isinstance(config, tuple) else (config,)
        for repeat in repeats:
            if repeat == 1:
                builds.append((variant, config, plan_opts, 1))
                continue
            if any(c.wgmma for c in configs):
                raise SystemExit(
                    f"--mma-repeat {repeat}: {variant} runs warpgroup MMAs, which VMLA_MMA_REPEAT leaves as they are"
                )
            repeated = each_with(configs, f"VMLA_MMA_REPEAT={repeat}")
            builds.append((f"{variant}_mma_x{repeat}", repeated if isinstance(config, tuple) else repeated[0], plan_opts, repeat))
    return builds


def measure_mma_ceilings(repeats: list[int]) -> dict:
    """{"repeat<n> chains<c> blocks<b>": ceilings}: the mma.sync microkernels with every MMA issued n times, the raw
    one on c independent accumulators a warp (the verify kernel's QK has 4 a warp, its P V 16), b blocks of 8 warps
    an SM (kdtree bench's 4, and the verify kernel's 1)."""
    result = {}
    for repeat in repeats:
        for blocks in (BLOCKS_PER_SM, 1):
            for chains in (2, 4, 8):
                c = mma_sync_ceilings(bench.median_ms, f"-DVMLA_MMA_REPEAT={repeat}", chains=chains, blocks_per_sm=blocks)
                result[f"repeat{repeat} chains{chains} blocks{blocks}"] = c
                print(
                    f"mma.sync ceilings, every MMA issued {repeat}x, raw on {chains} accumulators a warp, {blocks} "
                    "blocks of 8 warps an SM (TFLOP/s, each MMA counted once): " + ", ".join(f"{k} {v:.0f}" for k, v in c.items())
                )
    return result


def time_case(case, builds, timings: int) -> dict:
    """{build name: timing and plan facts} for one bench case, the builds timed `timings` times interleaved. The
    bit-equality column compares each build with the first one whose MMAs are not repeated (None for repeated ones,
    whose sums are wrong by design)."""
    cap = synthesize(case.spec(), reference=False)
    args = marshal(cap)
    dev = args.to("cuda")
    sets = bench.rotations(cap, 2)
    flops = bench.case_flops(cap)
    T, H = cap.num_tokens, cap.meta.num_heads
    o = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(T, H, device="cuda")
    rows, fns, ref = {}, {}, None
    for name, config, plan_opts, mma_repeat in builds:
        plan_opts = dict(plan_opts)
        pdl = plan_opts.pop("_pdl", None)  # the merge as a programmatic dependent (default: where available)
        merge_threads = plan_opts.pop("_merge_threads", MERGE_THREADS)
        try:
            kern = VerifyKernel.get(config)
            pdl = pdl_available() if pdl is None else pdl
            k = plan_opts.pop("_tiles_a_block", None)
            if plan_opts.pop("_choose", False):
                p = kern.plan(args, H)
            else:
                p = plan(args, H, kern.num_sms, config, **plan_opts)
            if k is not None:
                p = plan(args, H, kern.num_sms, config, **plan_opts, grid=-(-p.row_tiles // k))
            p = p.to("cuda")
            ws = Workspace.for_plan(p)

            def step(q, pool, kern=kern, p=p, ws=ws, pdl=pdl, mt=merge_threads):  # (variants may share a kernel)
                kern.pdl, kern.merge_threads = pdl, mt
                kern.launch(p, dev, q, pool, o, lse, ws)

            fn = bench.cycling(sets, step)
            fn()
            torch.cuda.synchronize()
            rel = None
            if mma_repeat == 1:
                ref = o.float().clone() if ref is None else ref
                rel = float((o.float() - ref).norm() / ref.norm())
            attrs = kern.compiled(p.config)[1].attributes  # the planned configuration's forward kernel
            rows[name] = {
                "rel_vs_first": rel,
                "ms_runs": [],
                "regs": attrs["num_regs"],
                "local": attrs["local_size_bytes"],
                "grid": p.grid,
                "units": p.units,
                "work": p.work,
                "segments": p.segments,
                "fused": p.fused_merge,
                "body": p.config.body,
            }
            fns[name] = fn
        except Exception as e:  # noqa: BLE001
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for _ in range(timings):  # the variants interleaved, so that drift in the machine hits them alike
        for name, fn in fns.items():
            rows[name]["ms_runs"].append(bench.median_ms(fn))
    for name in fns:
        r = rows[name]
        r["ms"] = statistics.median(r["ms_runs"])
        r["tflops"] = flops / r["ms"] / 1e9
    return rows


def print_case(case_name: str, rows: dict) -> None:
    width = max(map(len, rows), default=0)
    print(case_name)
    for name, r in rows.items():
        if "ms" not in r:
            print(f"   {name:{width}s} {r['error']}")
            continue
        rel = "-" if r["rel_vs_first"] is None else f"{r['rel_vs_first']:.1e}"
        print(
            f"   {name:{width}s} {r['ms']:8.3f} ms {r['tflops']:6.0f} TF/s rel {rel} regs {r['regs']} local {r['local']} B "
            f"grid {r['grid']} segments {r['segments']} body {r['body']} runs {'/'.join(f'{x:.4f}' for x in r['ms_runs'])}"
        )
    sys.stdout.flush()


def main():
    a = parse_args()
    builds = expand_builds(a.variants, a.mma_repeat)
    path = a.json or Path(os.environ.get("OUT", "."), "variants.json")
    result = {"mma_ceilings": measure_mma_ceilings(a.mma_repeat) if a.mma_ceilings else {}, "cases": {}}
    for case in bench.select_cases(a.cases, probes=True):
        result["cases"][case.name] = time_case(case, builds, a.repeat)
        print_case(case.name, result["cases"][case.name])
        path.write_text(json.dumps(result, indent=1))  # after every case: a call cut short keeps what it timed


if __name__ == "__main__":
    main()
