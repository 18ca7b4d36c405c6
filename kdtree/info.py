"""What a capture holds, in numbers: batch, prefixes, trees, heads, pool fragmentation."""

from __future__ import annotations

import torch

from kdtree.capture import Capture
from kdtree.errors import printable
from kdtree.trees import branching, depths


def slot_runs(slots: torch.Tensor) -> int:
    """Number of maximal runs of consecutive slot ids (1 = one contiguous block)."""
    if slots.numel() == 0:
        return 0
    s = slots.long()
    return int((s[1:] != s[:-1] + 1).sum()) + 1


def request_summary(cap: Capture, b: int) -> dict:
    parents = cap.parents(b)
    d, br = depths(parents), branching(parents)
    combined = torch.cat([cap.prefix_slots(b), cap.draft_slots(b)])
    return {
        "request": b,
        "prefix_len": int(cap.prefix_lens[b]),
        "num_draft": int(cap.num_draft[b]),
        "depth": int(d.max()),
        "leaves": int((br == 0).sum()),
        "max_branching": int(br.max()),
        # SGLang pads a short NGRAM draft with children of the root, so only a node below it shows a real branch
        "max_branching_below_root": int(br[1:].max()) if br.size > 1 else 0,
        "mean_branching": float(br[br > 0].mean()) if (br > 0).any() else 0.0,
        "slot_runs": slot_runs(combined),
    }


def summarize(cap: Capture) -> dict:
    m = cap.meta
    reqs = [request_summary(cap, b) for b in range(cap.batch_size)]
    referenced = int(cap.kv_buffer_slots.numel())
    kv_tokens = int(cap.prefix_lens.sum() + cap.num_draft.sum())
    return {
        "path": cap.where,
        "model": m.model,
        "source": m.source.get("kind"),
        "reference": m.reference,
        "spec_algorithm": m.spec_algorithm,
        "tree_budget": m.tree_budget,
        "batch_size": cap.batch_size,
        "num_heads": m.num_heads,
        "sm_scale": m.sm_scale,
        "logit_cap": m.logit_cap,
        "layers": m.layer_ids,
        "num_tokens": cap.num_tokens,
        "prefix_lens": [r["prefix_len"] for r in reqs],
        "num_draft": sorted({r["num_draft"] for r in reqs}),
        "pool": {
            "pool_size": m.pool_size,
            "page_size": m.page_size,
            "referenced_slots": referenced,
            "occupancy": referenced / m.pool_size,
            "mean_run_length": kv_tokens / max(1, sum(r["slot_runs"] for r in reqs)),
        },
        "requests": reqs,
    }


def format_summary(s: dict) -> str:
    pool = s["pool"]
    lines = [
        printable(s["path"]),
        f"  model {printable(s['model'])}  source {printable(s['source'])}  o from {printable(s['reference'])}  "
        f"spec {printable(s['spec_algorithm'])}" + (f" budget {s['tree_budget']}" if s["tree_budget"] else ""),
        f"  batch {s['batch_size']}  N {s['num_draft']}  heads {s['num_heads']}  sm_scale {s['sm_scale']:.6f}"
        + (f"  logit_cap {s['logit_cap']}" if s["logit_cap"] else "")
        + f"  layers {s['layers']}  tokens {s['num_tokens']}",
        f"  pool {pool['pool_size']} slots (page {pool['page_size']}), {pool['referenced_slots']} referenced "
        f"({100 * pool['occupancy']:.1f}%), mean run of consecutive slots {pool['mean_run_length']:.1f}",
        "  req  prefix_len    N  depth  leaves  max_branch  below_root  slot_runs",
    ]
    for r in s["requests"]:
        lines.append(
            f"  {r['request']:>3}  {r['prefix_len']:>10}  {r['num_draft']:>3}  {r['depth']:>5}  {r['leaves']:>6}  "
            f"{r['max_branching']:>10}  {r['max_branching_below_root']:>10}  {r['slot_runs']:>9}"
        )
    return "\n".join(lines)
