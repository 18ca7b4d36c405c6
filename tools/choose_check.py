"""Does the cost model pick the fastest configuration? Each batch (bench cases by substring, and fuzz batches by
seed) planned with every candidate of this GPU's target, each on the plan `choose_plan` would make with it alone
(row tiles to their last visible key or over all keys, one tile a block over L2), and timed (median, L2 flushed),
beside the one `choose_plan` picks (an aligned plan on blocks64, "blocks64-aligned", beside that body's balanced
plan); prints one line a batch and the geomean of the pick's time over the fastest, writes
choose-check.json to $OUT.

Usage: python3 tools/choose_check.py [--cases substring ...] [--fuzz N] [--seeds S ...]   (needs a GPU)
"""

import argparse
import json
import math
import os
from pathlib import Path

import triton.testing

from kdtree import bench
from kdtree.fuzz import fuzz_spec
from kdtree.kernel import KernelConfig, VerifyKernel, device_arch
from kdtree.kernel.planner import choose_plan, estimated_cost
from kdtree.marshal import marshal
from kdtree.synth import synthesize


def median_ms(kern, run: bench.CaseLaunch) -> float:
    return triton.testing.do_bench(lambda: run.launch(kern), warmup=10, rep=50, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=[])
    ap.add_argument("--fuzz", type=int, default=0, help="fuzz batches (seeds 0 .. N-1)")
    ap.add_argument("--seeds", type=int, nargs="*", default=[], help="fuzz batches of these seeds")
    a = ap.parse_args()
    configs = KernelConfig.candidates(device_arch())
    kerns = {c: VerifyKernel.get(c) for c in configs}
    l2 = next(iter(kerns.values())).l2_bytes
    batches = [(c.name, c.spec()) for c in bench.select_cases(a.cases, probes=True)] if a.cases else []
    batches += [(f"fuzz {s}", fuzz_spec(s)) for s in [*range(a.fuzz), *a.seeds]]
    rows, ratios = {}, []
    for name, spec in batches:
        cap = synthesize(spec, reference=False)
        args, H = marshal(cap), cap.meta.num_heads
        dev, lid = args.to("cuda"), cap.meta.layer_ids[0]
        q, pool = cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        pick = choose_plan(args, H, kerns[configs[0]].num_sms, configs, l2_bytes=l2)
        times = {}
        for c, kern in kerns.items():  # each configuration on the plan the cost model would run it with
            p = (pick if c == pick.config else choose_plan(args, H, kern.num_sms, (c,), l2_bytes=l2)).to("cuda")
            times[c.body] = median_ms(kern, bench.CaseLaunch(cap, p, dev, q, pool, *bench.launch_outputs(cap, p)))
            if p.aligned:  # ... and that body's balanced plan, under its own name
                times[c.body + "-aligned"] = times[c.body]
                p = choose_plan(args, H, kern.num_sms, (c,), l2_bytes=l2, aligned=False).to("cuda")
                times[c.body] = median_ms(kern, bench.CaseLaunch(cap, p, dev, q, pool, *bench.launch_outputs(cap, p)))
        picked = pick.config.body + ("-aligned" if pick.aligned else "")
        fastest = min(times, key=times.get)
        ratios.append(times[picked] / times[fastest])
        rows[name] = {"times_ms": times, "picked": picked, "grid": pick.grid, "cost": estimated_cost(pick)}
        line = "  ".join(f"{k} {v:.4f}" for k, v in times.items())
        print(f"{name[:30]:30s} picked {picked:6s} fastest {fastest:6s} x{ratios[-1]:.3f} | {line}", flush=True)
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"geomean of the pick's time over the fastest: {geo:.4f} over {len(ratios)} batches")
    Path(os.environ.get("OUT", "."), "choose-check.json").write_text(json.dumps({"batches": rows, "geomean": geo}, indent=1))


if __name__ == "__main__":
    main()
