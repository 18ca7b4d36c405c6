"""A large model's verify step, projected from a server bench: arithmetic on measured parts, not a measurement.

The bench's profiled points give verify attention's GPU time per layer inside a live server, Triton's and
kdtree's, at the model's heads per rank. A large model's step is then `layers x that + the rest`, where the rest
(the MoE and dense GEMMs, communication, the host) is not measured here: it is an assumption, given as a range,
and the projection says which. kdtree's per-layer time includes its once-a-step kernels (the plan, the marshal)
divided by the tiny model's layers, which overstates it at 61 layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """A model at a tensor-parallel size: its layers and attention heads per rank (MLA, q/k 576, v 512)."""

    name: str
    layers: int
    heads_per_rank: int


# Kimi K2.x (K2.6 keeps K2's attention): 61 layers, 64 heads; DeepSeek-V3: 61 layers, 128 heads
TARGETS = (Target("Kimi K2.6 at TP8", 61, 8), Target("DeepSeek-V3 at TP8", 61, 16))
# ms a step besides attention, assumed: ~11 ms is one decode token of Kimi K2.6 on 8 RTX PRO 6000 at no context
# (vLLM issue 40608: 89 tokens/s without MTP); a verify step of 16-64 tokens a request reads more experts
OTHER_MS = (10.0, 20.0, 40.0)


def project(pair: dict, bench_layers: int, target: Target, other_ms: float) -> dict:
    """One profiled pair of `kdtree bench --server` (its attention ms a step over `bench_layers` layers) carried
    to `target`'s layers with `other_ms` a step besides attention."""
    if bench_layers < 1 or other_ms < 0:
        raise ValueError(f"bench_layers >= 1 and other_ms >= 0 (got {bench_layers}, {other_ms})")
    t_layer = pair["triton_attention_ms"] / bench_layers
    k_layer = pair["kdtree_attention_ms"] / bench_layers
    triton_step = target.layers * t_layer + other_ms
    kdtree_step = target.layers * k_layer + other_ms
    return {
        "target": target.name,
        "layers": target.layers,
        "heads": pair["heads"],
        "draft_tokens": pair["draft_tokens"],
        "prompt_len": pair["prompt_len"],
        "batch": pair["batch"],
        "other_ms": other_ms,
        "triton_layer_ms": t_layer,
        "kdtree_layer_ms": k_layer,
        "triton_step_ms": triton_step,
        "kdtree_step_ms": kdtree_step,
        "triton_attention_share": target.layers * t_layer / triton_step if triton_step > 0 else None,
        "step_speedup": triton_step / kdtree_step if kdtree_step > 0 else None,
    }


def projections(pairs: list[dict], bench_layers: int, other_ms: tuple[float, ...] = OTHER_MS) -> list[dict]:
    """Every profiled pair carried to the target with its heads per rank, at each assumed `other_ms`."""
    out = []
    for p in pairs:
        if p.get("triton_attention_ms") is None or p.get("kdtree_attention_ms") is None:
            continue
        for target in (t for t in TARGETS if t.heads_per_rank == p["heads"]):
            out += [project(p, bench_layers, target, o) for o in other_ms]
    return out


def format_projections(rows: list[dict]) -> str:
    """The projections as a markdown table, a row per point and a column per assumed rest (empty when no point
    was profiled)."""
    if not rows:
        return ""
    key = lambda r: (r["target"], r["draft_tokens"], r["prompt_len"], r["batch"])  # noqa: E731
    points = {key(r): [] for r in rows}
    for r in rows:
        points[key(r)].append(r)
    rests = sorted({r["other_ms"] for r in rows})
    head = (
        "| model (projected) | draft | prompt | batch | attention a layer, Triton / kdtree (ms) | "
        + " | ".join(f"step speed-up, rest {o:g} ms" for o in rests)
        + " |\n|"
        + "---|" * (5 + len(rests))
    )
    lines = []
    for (target, draft, n, b), rs in points.items():
        by_rest = {r["other_ms"]: r for r in rs}
        cells = [f"{by_rest[o]['step_speedup']:.1f}x" if o in by_rest else "" for o in rests]
        lines.append(
            f"| {target} | {draft} | {n} | {b} | {rs[0]['triton_layer_ms']:.2f} / {rs[0]['kdtree_layer_ms']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join([head, *lines])
