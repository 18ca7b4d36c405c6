"""`kdtree bench --sglang`: the kdtree backend against SGLang's Triton backend on the same `ForwardBatch`es, in
the same run, eager and replayed from CUDA graphs.

Each case is built with SGLang's attention test kit (`kdtree.sglang.kit`: real ForwardBatch, ReqToTokenPool,
MLATokenToKVPool, EagleVerifyInput with a DDTree custom mask), random bf16 q and pool (not zeros). Per case:
- `layer_ms`: GPU time of one layer's `forward_extend` (kdtree's with the step already marshaled and planned),
  eager and replayed from a CUDA graph of that one layer (`*_graph`), and kdtree's call recorded with no metadata hook
  before it, so the layer marshals and plans itself (`kdtree_graph_with_marshal_plan`);
- `step_metadata_ms`: GPU time of what a verify step does once before its layers: Triton's
  `init_forward_metadata`; kdtree's step (its `init_forward_metadata`, which builds no Triton metadata and
  marshals and plans from SGLang's page table: `kdtree_step`), and marshal + plan alone;
- `host_us`: host time per step outside the kernels, the same calls; under CUDA graphs,
  `init_forward_metadata_out_graph` before a replay (all the host work a replayed step has: kdtree's refills
  the mask buffer only, `graph_without_triton_metadata` says the captured graph ran no Triton kernel).
Medians of `triton.testing.do_bench` (L2 flushed) for GPU times; host times are medians of perf_counter
over 200 calls, each timed without a sync and followed by one.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from kdtree.bench import BENCH_CASES
from kdtree.presets import get_preset
from kdtree.serving import captured
from kdtree.trees import make_tree


@dataclass(frozen=True)
class ServingCase:
    name: str
    num_heads: int
    prefix_lens: tuple[int, ...]
    num_draft: int
    scaling: float


SERVING_CASES = [
    ServingCase(c.name, get_preset(c.preset).num_heads, c.prefix_lens, c.num_draft, get_preset(c.preset).sm_scale)
    for c in BENCH_CASES
]


def _host_us(fn, reps: int = 200) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def _graph_ms(fn, do_bench) -> float:
    graph = captured(fn)
    graph.replay()
    return do_bench(graph.replay)


def run_case(case: ServingCase, do_bench) -> dict:
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from kdtree.sglang import kit

    bs, n, H = len(case.prefix_lens), case.num_draft, case.num_heads
    vcase = kit.verify_case(case.name.replace(" ", "_"), "kdtree", case.prefix_lens, n, H)
    rng = np.random.default_rng(0)
    trees = [make_tree("ddtree", n, rng) if n > 1 else np.array([-1]) for _ in range(bs)]
    fixture, _ = kit.verify_fixture(vcase, trees, scaling=case.scaling, disable_cuda_graph=False, runner_batch_size=bs)
    backend, fb, layer = fixture.backend, fixture.forward_batch, fixture.actual_module.attn_mqa
    fb.seq_lens = fb.seq_lens.long()  # as SGLang's ScheduleBatch holds them (the kit's are int32)
    pool = backend.token_to_kv_pool.get_key_buffer(0)
    pool.copy_(torch.randn_like(pool, dtype=torch.float32).to(pool.dtype))
    q = torch.randn(bs * n, H * 576, device="cuda").to(torch.bfloat16)
    kdtree_call = lambda: backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)  # noqa: E731
    triton_call = lambda: TritonAttnBackend.forward_extend(backend, q, None, None, layer, fb, save_kv_cache=False)  # noqa: E731
    out = {"name": case.name, "batch_size": bs, "num_draft": n, "num_heads": H, "prefix_lens": list(case.prefix_lens)}
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        # eager: kdtree's step builds no Triton metadata; Triton's is built for its own calls
        backend.init_forward_metadata(fb)
        o_k = kdtree_call().clone()
        backend.ensure_triton_metadata(fb)
        o_t = triton_call().clone()
        out["rel_vs_triton"] = float((o_k.double() - o_t.double()).norm() / o_t.double().norm())
        path = backend.runner.path
        batch = backend.verify_batch(fb)
        prep = lambda: batch.prepare(path, H)  # noqa: E731
        step_kdtree = lambda: backend.init_forward_metadata(fb)  # noqa: E731 - marshal + plan included
        meta = lambda: TritonAttnBackend.init_forward_metadata(backend, fb)  # noqa: E731
        out["layer_ms"] = {"kdtree": do_bench(kdtree_call), "triton": do_bench(triton_call)}
        out["step_metadata_ms"] = {
            "triton": do_bench(meta),
            "kdtree": do_bench(step_kdtree),
            "kdtree_marshal_plan": do_bench(prep),
        }
        out["host_us"] = {
            "triton_metadata": _host_us(meta),
            "kdtree_step": _host_us(step_kdtree),
            "kdtree_marshal_plan": _host_us(prep),
        }
        # CUDA graphs: Triton's graph buffers, SGLang's out-of-graph hook, one layer's call recorded
        backend.init_cuda_graph_state(bs, bs * n)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        # one layer alone: the step marshaled and planned beforehand, the graph holds the layer's kernels
        step = backend.verify_batch(fb).prepare(path, H)
        o_graph = torch.empty(bs * n, H, 512, dtype=torch.bfloat16, device="cuda")
        layer_only = lambda: path.launch(step, q.view(-1, H, 576), pool, o_graph, sm_scale=layer.scaling)  # noqa: E731
        out["layer_ms"]["kdtree_graph"] = _graph_ms(layer_only, do_bench)
        out["layer_ms"]["triton_graph"] = _graph_ms(triton_call, do_bench)
        # the backend's call recorded with no metadata hook before it: marshal + plan prepared in the layer, then the layer
        out["layer_ms"]["kdtree_graph_with_marshal_plan"] = _graph_ms(kdtree_call, do_bench)
        # before a replay: kdtree's hook (its graph ran no Triton kernel: the mask copy only) and Triton's
        out["host_us"]["out_graph_kdtree"] = _host_us(lambda: backend.init_forward_metadata_out_graph(fb))
        out["graph_without_triton_metadata"] = bs in backend._kdtree_graphs
        out["host_us"]["out_graph_triton"] = _host_us(lambda: TritonAttnBackend.init_forward_metadata_out_graph(backend, fb))
    lm = out["layer_ms"]
    out["speedup"] = {"eager": lm["triton"] / lm["kdtree"], "graph": lm["triton_graph"] / lm["kdtree_graph"]}
    return out


def run(cases=SERVING_CASES, log=print) -> dict:
    import sglang
    import triton.testing

    def do_bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    results = []
    for case in cases:
        try:
            r = run_case(case, do_bench)
        except Exception as e:  # noqa: BLE001 - report and go on with the other cases
            r = {"name": case.name, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        log(format_row(r))
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sglang": getattr(sglang, "__version__", "?"),
        "cases": results,
    }


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:28s} ERROR {r['error'][:120]}"
    lm, h, m = r["layer_ms"], r["host_us"], r["step_metadata_ms"]
    return (
        f"{r['name']:28s} layer kdtree {lm['kdtree']:.4f} / triton {lm['triton']:.4f} ms (x{r['speedup']['eager']:.1f}) "
        f"| graph {lm['kdtree_graph']:.4f} / {lm['triton_graph']:.4f} ms (x{r['speedup']['graph']:.1f}), "
        f"+marshal+plan {lm['kdtree_graph_with_marshal_plan']:.4f} | step {m['kdtree']:.4f} / {m['triton']:.4f} ms GPU, "
        f"host eager {h['kdtree_step']:.0f} / {h['triton_metadata']:.0f} us | out_graph host {h['out_graph_kdtree']:.0f} / "
        f"{h['out_graph_triton']:.0f} us | rel {r['rel_vs_triton']:.2e}"
    )


def save(result: dict, path) -> None:
    """The result as JSON at `path` and its figure (`kdtree.plots.sglang_bench_figure`) beside it (.png)."""
    from pathlib import Path

    from kdtree.plots import sglang_bench_figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    sglang_bench_figure(result).savefig(path.with_suffix(".png"), dpi=110, bbox_inches="tight")
