"""How much of a bench case's time is the host's launch: the kdtree launch `kdtree bench` times (the cost
model's plan, rotated inputs, L2 flushed) called eagerly and replayed from CUDA graphs, in one run, with SGLang's
Triton kernel both ways where it imports.

Usage: python3 experiments/launch_overhead.py [--cases substring ...] [--repeat N]   (needs a GPU)
"""

import argparse

import torch
import triton.testing

from kdtree import bench
from kdtree.marshal import marshal
from kdtree.sglang import extend_attention, verify_call
from kdtree.synth import synthesize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["small tree", "4k", "N1", "mixed"])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    ext, _ = extend_attention()

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    for case in bench.select_cases(a.cases, probes=True):
        cap = synthesize(case.spec(), reference=False)
        args = marshal(cap)
        sets = bench.rotations(cap, bench.rotation_copies(bench.case_bytes(cap)))
        step, _, _ = bench.kdtree_step(cap, args)
        fns = {"kdtree eager": bench.cycling(sets, step)}
        fns["kdtree graph"], how = bench.graphed(sets, step)
        if ext is not None:
            call, _ = verify_call(cap, cap.meta.layer_ids[0], ext)
            fns["sglang eager"] = bench.cycling(sets, call)
            fns["sglang graph"], how_sglang = bench.graphed(sets, call)
            how = how if how == how_sglang else f"kdtree {how}, sglang {how_sglang}"
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        times = {k: [ms(fn) for _ in range(a.repeat)] for k, fn in fns.items()}
        line = "  ".join(f"{k} {min(v):.4f}-{max(v):.4f}" for k, v in times.items())
        print(f"{case.name:28s} {line}  ({len(sets)} input copies; graphs: {how})", flush=True)


if __name__ == "__main__":
    main()
