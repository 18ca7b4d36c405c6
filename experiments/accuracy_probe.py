"""Worst-element error of kernel variants on the shipped captures (one device call): max_abs and rel against the
fp64 oracle per configuration and plan, next to SGLang-numerics emulation's, with the worst element's value.

Usage: python3 experiments/accuracy_probe.py   (needs a GPU)
"""

from pathlib import Path

import torch

from kdtree.capture import load  # noqa: E402
from kdtree.diff import compare  # noqa: E402
from kdtree.kernel import KernelConfig, VerifyKernel, Workspace, plan  # noqa: E402
from kdtree.marshal import marshal  # noqa: E402
from kdtree.outputs import AttnOutput, poisoned  # noqa: E402
from kdtree.reference import emulate_triton, oracle  # noqa: E402

BM64 = KernelConfig.for_arch("sm_90")
VARIANTS = {
    "bm64": (BM64, {}),
    "bm64 37sms": (BM64, {"num_sms": 37}),
    "bm32": (KernelConfig(), {}),
    "wgmma": (KernelConfig.for_arch("sm_90a"), {}),
}

for path in sorted(Path("data/captured_batches").glob("*.safetensors")):
    cap = load(path)
    lid = cap.meta.layer_ids[0]
    ref = oracle(cap, lid, device="cuda")
    emu = compare(cap, lid, emulate_triton(cap, lid, device="cuda"), ref)
    print(f"{path.stem:16s} emulation      max_abs {emu.max_abs:.4f} rel {emu.rel:.3e} worst {emu.worst}")
    args = marshal(cap)
    dev = args.to("cuda")
    q, pool = cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
    T, H = cap.num_tokens, cap.meta.num_heads
    for name, (config, opts) in VARIANTS.items():
        kern = VerifyKernel.get(config)
        p = plan(args, H, opts.get("num_sms", kern.num_sms), config).to("cuda")
        o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
        kern.launch(p, dev, q, pool, o, lse, Workspace.for_plan(p))
        d = compare(cap, lid, AttnOutput(o, lse), ref)
        w = d.worst
        t = int(cap.qo_indptr[w["request"]]) + w["node"]
        err = (o[t, w["head"]].double() - ref.o[t, w["head"]].double().to(o.device)).abs()
        c = int(err.argmax())
        print(
            f"{'':16s} {name:14s} max_abs {d.max_abs:.4f} rel {d.rel:.3e} ratio {d.max_abs / emu.max_abs:.2f} "
            f"worst (req {w['request']} node {w['node']} head {w['head']} col {c}) got {float(o[t, w['head'], c]):.4f} "
            f"want {float(ref.o[t, w['head'], c]):.4f} segments {p.segments} fused {p.fused_merge}"
        )
