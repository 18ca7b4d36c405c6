"""Benchmark v1: the kernel against SGLang's Triton `extend_attention_fwd` (when importable) and a plain
torch implementation, **in the same run**, with the roofline from ceilings measured in that run.

Timing: `triton.testing.do_bench` medians (it flushes L2 before every repetition), inputs rotated among
several copies so repeated runs do not measure the cache. kdtree's launch and SGLang's kernel are replayed from
CUDA graphs, one a copy, as a server replays its verify step (`graphed`: on a small batch the host's launch
overhead would otherwise be timed in place of the kernel), and so is FlashInfer's wrapper where it captures (each
record's `launch` says how it ran); the torch reference runs eagerly. FLOPs are the dense count
sum_b 2 * N * H * (prefix_b + N) * (576 + 512); bytes are q + o + the pool rows the step reads. The kernel's
gather rate counts the pool rows its plan loads into shared memory (a row once for every row tile that reads it),
held against the L2 gather ceiling (kdtree.ceilings).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kdtree.capture import Capture
from kdtree.ceilings import POOL_ROW_BYTES
from kdtree.kernel.config import source_hash
from kdtree.marshal import VerifyArgs, marshal
from kdtree.synth import SynthSpec, synthesize


@dataclass(frozen=True)
class BenchCase:
    name: str
    preset: str
    prefix_lens: tuple[int, ...]
    num_draft: int  # N = budget + 1 (a DDTree), or N of a chain (N 1: no draft tree, one token a request)
    chain: bool = False  # the draft as a chain of N nodes instead of a DDTree (what EAGLE with topk 1 verifies)

    def spec(self) -> SynthSpec:
        if self.chain or self.num_draft == 1:
            tree = dict(tree="chain", num_draft_tokens=self.num_draft)
        else:
            tree = dict(budget=self.num_draft - 1)
        return SynthSpec(preset=self.preset, batch_size=len(self.prefix_lens), prefix_lens=list(self.prefix_lens), seed=0, **tree)

    def as_chain(self) -> "BenchCase":
        """The same prefixes and N with a chain draft (`kdtree bench --chain`: FlashInfer's causal MLA kernel
        computes the same attention there)."""
        if self.chain or self.num_draft == 1:
            return dataclasses.replace(self, chain=True)
        return dataclasses.replace(self, name=f"{self.name} chain", chain=True)


# The eight anchor cases (../shared/docs/anchors.md)
ANCHOR_CASES = [
    BenchCase("kimi-tp8 small tree", "kimi-k2-tp8", (2048,) * 16, 17),
    BenchCase("kimi-tp8 ddtree64 4k", "kimi-k2-tp8", (4096,), 65),
    BenchCase("kimi-tp8 ddtree64 8k x8", "kimi-k2-tp8", (8192,) * 8, 65),
    BenchCase("kimi-tp8 ddtree256 32k x4", "kimi-k2-tp8", (32768,) * 4, 257),
    BenchCase("kimi-tp8 ddtree64 128k", "kimi-k2-tp8", (131072,), 65),
    BenchCase("dsv3-tp8 ddtree64 8k x8", "deepseek-v3-tp8", (8192,) * 8, 65),
    BenchCase("kimi-dp ddtree32 8k x4", "kimi-k2-dp", (8192,) * 4, 33),
    BenchCase("kimi-tp8 mixed", "kimi-k2-tp8", (100, 1500, 7000, 20000, 3, 45000), 65),
]

# Shapes outside the eight anchors: the largest DDTree budget at 8k, DP attention's 64 heads at 32k x8, a
# chain-less step (64 requests of one token at 4k), DeepSeek-V3 with a 256 budget at 32k x2
EXTRA_CASES = [
    BenchCase("kimi-tp8 ddtree1024 8k", "kimi-k2-tp8", (8192,), 1025),
    BenchCase("kimi-dp ddtree32 32k x8", "kimi-k2-dp", (32768,) * 8, 33),
    BenchCase("kimi-tp8 64 x N1 4k", "kimi-k2-tp8", (4096,) * 64, 1),
    BenchCase("dsv3-tp8 ddtree256 32k x2", "deepseek-v3-tp8", (32768,) * 2, 257),
]
# What `kdtree bench` times: the anchors, then the shapes outside them (twelve)
BENCH_CASES = ANCHOR_CASES + EXTRA_CASES

# Probe cases for experiments (tools/variants.py, tools/trace_case.py; not benchmarked): the small tree's
# 16 x 2,048 prefixes at other tree sizes, to see what the rows past the last full 64-row tile cost
# (H 8: N 8 = 64 rows, N 9 = 64 + 8, N 16 = 128, N 2 = 16).
PROBE_CASES = [BenchCase(f"small tree N{n}", "kimi-k2-tp8", (2048,) * 16, n) for n in (2, 8, 9, 16)]


def select_cases(patterns: list[str], *, probes: bool = False) -> list[BenchCase]:
    """Bench cases whose name contains one of `patterns`, then (probes) the probe cases named exactly."""
    picked = [c for c in BENCH_CASES if any(p in c.name for p in patterns)]
    return picked + [c for c in PROBE_CASES if probes and c.name in patterns]


def case_flops(cap: Capture) -> float:
    H = cap.meta.num_heads
    n, p = cap.num_draft.double(), cap.prefix_lens.double()
    return float((2 * n * H * (p + n) * (cap.meta.head_dim + cap.meta.v_head_dim)).sum())


def case_bytes(cap: Capture) -> float:
    T, H = cap.num_tokens, cap.meta.num_heads
    keys = int((cap.prefix_lens + cap.num_draft).sum())
    return T * H * (cap.meta.head_dim + cap.meta.v_head_dim) * 2 + keys * cap.meta.head_dim * 2


def median_ms(fn) -> float:
    """The bench's timing of `fn`: `triton.testing.do_bench`'s median (L2 flushed before every repetition), 25 ms of
    warm-up and 100 of repetitions (triton imported here: it needs a GPU)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# ----- ceilings ----------------------------------------------------------------------------------
def measure_ceilings(do_bench) -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b)
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms_copy = do_bench(lambda: dst.copy_(src))
    result = {
        "matmul_bf16_tflops": 2 * n**3 / ms / 1e9,
        "copy_tbps": 2 * src.numel() * 4 / ms_copy / 1e9,
        "how": "8192^3 bf16 torch matmul on random data; 1 GiB device copy counting read + write; mma.sync "
        "m16n8k16 bf16 microkernels (kernels/mma_ceiling.cu): operands in registers, and fed by ldmatrix; "
        "pool rows gathered into shared memory by cp.async, one block an SM (kernels/gather_ceiling.cu), "
        "from a 9.4 MB pool (L2) with 4 and 2 stages and from a 4.8 GB one (HBM)",
    }
    from kdtree.ceilings import gather_ceilings, mma_sync_ceilings

    for key, measure in (("mma_sync", mma_sync_ceilings), ("gather", gather_ceilings)):
        try:
            result.update(measure(do_bench))
        except Exception as e:  # noqa: BLE001 - the other ceilings stand; the record says why these are missing
            result[f"{key}_error"] = f"{type(e).__name__}: {e}"
    return result


# ----- implementations under test ----------------------------------------------------------------
def rotations(cap: Capture, copies: int):
    """`copies` distinct (q, pool) input sets on the GPU."""
    lid = cap.meta.layer_ids[0]
    q0, pool0 = cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
    sets = [(q0, pool0)]
    for i in range(1, copies):
        sets.append((q0.roll(i, dims=1).contiguous(), pool0.roll(i, dims=2).contiguous()))
    return sets


def rotation_copies(nbytes: float, min_rotation_bytes: float = 3 * 60e6) -> int:
    """How many input copies a case rotates through: enough that together they pass `min_rotation_bytes` (3x the
    H200's L2 by default), 1 to 6."""
    return max(1, min(6, math.ceil(min_rotation_bytes / max(nbytes, 1))))


def cycling(sets, step):
    """fn() calling step(q, pool) on the next of the rotated input sets each time (each timed call reads
    other inputs than the last)."""
    it = itertools.cycle(sets)
    return lambda: step(*next(it))


def graphed(sets, step):
    """(fn, how): fn() replays, in turn, one CUDA graph a rotated input set, each holding step(q, pool), as a
    server replays its verify step: the host's launch overhead, which on a small batch can exceed the kernel's own
    time, stays out of the timing. Where capture fails, fn calls step eagerly (`cycling`) and `how` says why."""
    from kdtree.serving import captured

    try:
        graphs = [captured(lambda q=q, pool=pool: step(q, pool)) for q, pool in sets]
    except Exception as e:  # noqa: BLE001 - time it eagerly; the record says why
        return cycling(sets, step), f"eager (graph capture failed: {type(e).__name__}: {e})"
    it = itertools.cycle(graphs)

    def replay():
        next(it).replay()

    replay.holds = (step, sets)  # the graphs read the tensors these hold (plan, outputs, inputs): keep them alive
    return replay, "cuda graph"


def launch_outputs(cap: Capture, p, device="cuda"):
    """(o [T, H, 512] bf16, lse [T, H], workspace): what a launch of plan `p` on `cap`'s batch writes."""
    from kdtree.kernel import Workspace

    T, H = cap.num_tokens, cap.meta.num_heads
    o = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    return o, torch.empty(T, H, device=device), Workspace.for_plan(p, device)


@dataclass
class CaseLaunch:
    """One bench case ready for `VerifyKernel.launch` on `device`: its capture, plan and marshaled arguments, layer
    0's q and pool, the outputs and workspace (what the timing and profiling scripts launch)."""

    cap: Capture
    plan: object  # kdtree.kernel.LaunchPlan
    args: VerifyArgs
    q: torch.Tensor
    pool: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    workspace: object  # kdtree.kernel.Workspace

    def launch(self, kern) -> None:
        kern.launch(self.plan, self.args, self.q, self.pool, self.o, self.lse, self.workspace)


def case_launch(case: BenchCase, plan_fn, device="cuda") -> CaseLaunch:
    """`case` synthesized, marshaled and planned by `plan_fn(args, num_heads)` (a host `LaunchPlan`), on `device`."""
    cap = synthesize(case.spec(), reference=False)
    args = marshal(cap)
    p = plan_fn(args, cap.meta.num_heads).to(device)
    return CaseLaunch(cap, p, args.to(device), cap.layer(0).q.to(device), cap.pool(0, device), *launch_outputs(cap, p, device))


def kdtree_step(cap: Capture, args: VerifyArgs):
    """(step, o, plan): step(q, pool) launches the kernel on the cost model's plan for `cap`'s batch into o."""
    from kdtree.kernel import VerifyKernel

    kern = VerifyKernel.get()
    p = kern.plan(args, cap.meta.num_heads).to("cuda")
    dev = args.to("cuda")
    o, lse, ws = launch_outputs(cap, p)
    return (lambda q, pool: kern.launch(p, dev, q, pool, o, lse, ws)), o, p


def kdtree_fn(cap: Capture, args: VerifyArgs, sets):
    step, o, p = kdtree_step(cap, args)
    fn, how = graphed(sets, step)
    info = {
        "launch": how,
        "grid": p.grid,
        "units": p.units,
        "gathered_bytes": gathered_bytes(p.units, p.config.bn),
        "stages": p.config.stages,
        "segments": p.segments,
        "bm": p.config.bm,
        "wgmma": p.config.wgmma,
        "few_rows": p.config.few_row_limit,
        "blocks64": p.config.blocks64,
        "aligned": p.aligned,
        "smem": p.config.smem_bytes,
    }
    return fn, o, info


def naive_fn(cap: Capture, args: VerifyArgs, sets):
    """Per request: gather the keys, two bf16 matmuls, masked fp32 softmax."""
    T, H = cap.num_tokens, cap.meta.num_heads
    o = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    qo = args.qo_indptr.tolist()
    kvp = args.combined_kv_indptr.tolist()
    idx = [args.combined_kv_indices[kvp[b] : kvp[b + 1]].long().cuda() for b in range(args.batch_size)]
    vis = []
    for b in range(args.batch_size):
        n, p = qo[b + 1] - qo[b], int(args.prefix_lens[b])
        m = torch.ones(n, p + n, dtype=torch.bool)
        m[:, p:] = cap.tree_block(b)
        vis.append(m.cuda().repeat_interleave(H, 0))
    scale = args.sm_scale

    def step(q, pool):
        for b in range(args.batch_size):
            k = pool[idx[b], 0]
            s = (q[qo[b] : qo[b + 1]].reshape(-1, 576) @ k.T).float() * scale
            pr = torch.softmax(s.masked_fill(~vis[b], float("-inf")), dim=-1).to(torch.bfloat16)
            o[qo[b] : qo[b + 1]] = (pr @ k[:, :512]).view(-1, H, 512)

    return cycling(sets, step), o, {}


def sglang_fn(cap: Capture, args: VerifyArgs, sets, extend_attention_fwd):
    """SGLang's Triton kernel, called as its backend does (kdtree.sglang)."""
    from kdtree.sglang import verify_call

    call, o = verify_call(cap, cap.meta.layer_ids[0], extend_attention_fwd)
    fn, how = graphed(sets, call)
    return fn, o, {"launch": how}


def flashinfer_fn(cap: Capture, args: VerifyArgs, sets, flashinfer, backends=None):
    """FlashInfer's MLA paged wrapper with a causal mask (chain drafts only; kdtree.flashinfer_mla), the first of
    `backends` that runs (default: its Hopper kernel, then its portable one)."""
    from kdtree.flashinfer_mla import BACKENDS, causal_step

    step, o, info = causal_step(cap, args, *sets[0], flashinfer, backends or BACKENDS)
    fn, how = graphed(sets, step)
    return fn, o, info | {"launch": how}


# ----- the run -----------------------------------------------------------------------------------
@dataclass
class CaseResult:
    name: str
    batch_size: int
    prefix_lens: list[int]
    num_draft: int
    num_heads: int
    flops: float
    bytes: float
    floor_ms: float
    impls: dict = field(default_factory=dict)  # name -> {"ms", "tflops", "floor_fraction", ...}


def run(
    cases=BENCH_CASES,
    *,
    with_sglang: bool = True,
    with_flashinfer: bool = False,
    flashinfer_backends=None,
    min_rotation_bytes: float = 3 * 60e6,
    log=print,
) -> dict:
    """Time every case with kdtree, torch, SGLang's Triton kernel (`with_sglang`, where it imports) and FlashInfer's
    causal MLA kernel (`with_flashinfer`, where it imports; chain cases only; the first of `flashinfer_backends`
    that runs), in this run, with its ceilings."""
    torch.manual_seed(0)
    ceilings = measure_ceilings(median_ms)
    log(
        f"ceilings: bf16 matmul {ceilings['matmul_bf16_tflops']:.0f} TFLOP/s, copy {ceilings['copy_tbps']:.2f} TB/s, "
        f"mma.sync raw {ceilings.get('mma_sync_raw_tflops', float('nan')):.0f} / ldmatrix-fed "
        f"{ceilings.get('mma_sync_ldmatrix_tflops', float('nan')):.0f} TFLOP/s, gather L2 "
        f"{ceilings.get('gather_l2_tbps', float('nan')):.2f} / {ceilings.get('gather_l2_2stages_tbps', float('nan')):.2f} "
        f"(2 stages), HBM {ceilings.get('gather_hbm_tbps', float('nan')):.2f} TB/s"
    )
    from kdtree.sglang import extend_attention

    ext, ext_what = extend_attention() if with_sglang else (None, "not asked for")
    log(f"SGLang: {ext_what}")
    fi, fi_what = (None, "not asked for")
    if with_flashinfer:
        from kdtree.flashinfer_mla import load

        fi, fi_what = load()
        log(f"FlashInfer: {fi_what}")
    results = []
    for case in cases:
        cap = synthesize(case.spec(), reference=False)
        args = marshal(cap)
        flops, nbytes = case_flops(cap), case_bytes(cap)
        floor_ms = max(flops / (ceilings["matmul_bf16_tflops"] * 1e9), nbytes / (ceilings["copy_tbps"] * 1e9))
        sets = rotations(cap, rotation_copies(nbytes, min_rotation_bytes))
        r = CaseResult(
            case.name, cap.batch_size, cap.prefix_lens.tolist(), case.num_draft, cap.meta.num_heads, flops, nbytes, floor_ms
        )
        impls = {"kdtree": lambda: kdtree_fn(cap, args, sets), "torch": lambda: naive_fn(cap, args, sets)}
        if ext is not None:
            impls["sglang"] = lambda: sglang_fn(cap, args, sets, ext)
        if fi is not None and case.chain:
            impls["flashinfer"] = lambda: flashinfer_fn(cap, args, sets, fi, flashinfer_backends)
        outs = {}
        for name, make in impls.items():
            try:
                fn, out, info = make()
                fn()  # also compiles / autotunes
                torch.cuda.synchronize()
                outs[name] = out.clone()
                ms = median_ms(fn)
                r.impls[name] = {"ms": ms, "tflops": flops / ms / 1e9, "floor_fraction": floor_ms / ms, **info}
            except Exception as e:  # noqa: BLE001 - report and go on with the other implementations
                r.impls[name] = {"error": f"{type(e).__name__}: {e}"}
        relate(r.impls, outs)
        if "tflops" in r.impls.get("kdtree", {}):
            k = r.impls["kdtree"]
            k["gather_tbps"] = k["gathered_bytes"] / k["ms"] / 1e9
            k["fraction_of"] = ceiling_fractions(k["tflops"], ceilings) | gather_fraction(k["gather_tbps"], k["stages"], ceilings)
        results.append(r)
        log(format_row(r))
        sets = outs = fn = out = None  # free this case's tensors and graphs before the next
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sglang": ext_what,
        "flashinfer": fi_what,
        "target": os.environ.get("KDTREE_KERNEL_TARGET") or "this GPU's",
        "kernel_sources": source_hash(),  # which kernels ran, by their sources' content
        "ceilings": ceilings,
        "cases": [asdict(r) for r in results],
        "geomean_speedup_vs_sglang": geomean([r.impls.get("kdtree", {}).get("speedup_vs_sglang") for r in results]),
        "geomean_speedup_vs_flashinfer": geomean([r.impls.get("kdtree", {}).get("speedup_vs_flashinfer") for r in results]),
    }


def relate(impls: dict, outs: dict) -> None:
    """kdtree's record against the others of one case (`impls`: name -> its record, `outs`: name -> its output):
    rel against SGLang's output (else torch's) and against FlashInfer's (an independent kernel on the same
    attention), and the speedup over each of SGLang and FlashInfer that has a time."""
    k = impls.get("kdtree")
    if k is None or "kdtree" not in outs:
        return
    a = outs["kdtree"].double()
    for base in (next((n for n in ("sglang", "torch") if n in outs), None), "flashinfer"):
        if base in outs:
            b = outs[base].double()
            k[f"rel_vs_{base}"] = float((a - b).norm() / b.norm())
    for base in ("sglang", "flashinfer"):
        if "ms" in impls.get(base, {}) and "ms" in k:
            k[f"speedup_vs_{base}"] = impls[base]["ms"] / k["ms"]


def ceiling_fractions(tflops: float, ceilings: dict) -> dict:
    """An achieved rate as fractions of each measured ceiling it can be held against (matmul, mma.sync)."""
    keys = ("matmul_bf16_tflops", "mma_sync_raw_tflops", "mma_sync_ldmatrix_tflops")
    return {k.removesuffix("_tflops"): tflops / ceilings[k] for k in keys if ceilings.get(k)}


def gathered_bytes(units: int, bn: int) -> int:
    """Pool-row bytes a launch gathers into shared memory: every (row tile, key tile) unit loads its BN rows."""
    return units * bn * POOL_ROW_BYTES


def gather_fraction(gather_tbps: float, stages: int, ceilings: dict) -> dict:
    """A launch's gather rate as a fraction of the L2 gather ceiling measured with its stage count (2, or 4)."""
    key = "gather_l2_2stages_tbps" if stages <= 2 else "gather_l2_tbps"
    return {"gather_l2": gather_tbps / ceilings[key]} if ceilings.get(key) else {}


def geomean(values) -> float | None:
    """Geometric mean of the values that are there (None where none is)."""
    xs = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else None


def format_row(r: CaseResult) -> str:
    cells = []
    for name in ("kdtree", "sglang", "flashinfer", "torch"):
        v = r.impls.get(name)
        if v is None:
            continue
        cells.append(f"{name} {v['ms']:.3f} ms ({v['tflops']:.0f} TF/s)" if "ms" in v else f"{name} ERROR {v['error'][:80]}")
    k = r.impls.get("kdtree", {})
    extra = "".join(f"  x{k[f'speedup_vs_{b}']:.2f} vs {b}" for b in ("sglang", "flashinfer") if f"speedup_vs_{b}" in k)
    extra += f"  floor {r.floor_ms:.3f} ms ({100 * k['floor_fraction']:.0f}% of it)" if "floor_fraction" in k else ""
    return f"{r.name:32s} " + " | ".join(cells) + extra


def summary_table(result: dict) -> str:
    """The bench as a table: per case the times, the speedup over SGLang, TFLOP/s, the floor (FLOPs at the matmul
    rate or bytes at the copy rate, whichever is longer) and the fraction of it reached, and where the mma.sync
    ceilings were measured the fraction of each (the sm_120 configuration's yardsticks)."""
    ceil = result["ceilings"]
    mma = bool(ceil.get("mma_sync_raw_tflops") and ceil.get("mma_sync_ldmatrix_tflops"))
    gath = bool(ceil.get("gather_l2_tbps"))
    fi = any("flashinfer" in c["impls"] for c in result["cases"])
    width = max([4] + [len(c["name"]) for c in result["cases"]])
    head = [f"{result['device']}" + (f", kernels {result['kernel_sources']}" if result.get("kernel_sources") else "")]
    rates = f"ceilings in this run: bf16 matmul {ceil['matmul_bf16_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s"
    if mma:
        rates += f", mma.sync {ceil['mma_sync_raw_tflops']:.0f} raw / {ceil['mma_sync_ldmatrix_tflops']:.0f} ldmatrix-fed TFLOP/s"
    head.append(rates)
    if gath:
        head.append(
            f"gather: L2 {ceil['gather_l2_tbps']:.2f} TB/s ({ceil.get('gather_l2_2stages_tbps', float('nan')):.2f} with 2 stages), "
            f"HBM {ceil.get('gather_hbm_tbps', float('nan')):.2f} TB/s"
        )
    if mma:  # the columns are fractions of ceilings measured with other instructions: say so
        head += [
            "%mma / %ldsm: TFLOP/s as a fraction of the mma.sync ceilings (raw; fed by ldmatrix from shared memory),",
            "  the sm_120 path's yardsticks; Hopper's warpgroup MMAs are not bound by them and pass 100 %",
        ]
    lines = [
        *head,
        f"{'case':{width}s} {'kdtree ms':>9s} {'sglang ms':>9s} {'torch ms':>8s} {'speedup':>7s} {'TF/s':>5s} {'floor ms':>8s} {'%floor':>6s}"
        + (f" {'%matmul':>7s} {'%mma':>5s} {'%ldsm':>5s}" if mma else "")
        + (f" {'gath TB/s':>9s} {'%gath':>5s}" if gath else "")
        + (f" {'fi ms':>8s} {'x fi':>6s} {'fi backend':>10s}" if fi else ""),
    ]
    for c in result["cases"]:
        k, s, t = (c["impls"].get(n, {}) for n in ("kdtree", "sglang", "torch"))
        f = lambda d, key, fmt: format(d[key], fmt) if key in d else "-"  # noqa: E731
        line = (
            f"{c['name']:{width}s} {f(k, 'ms', '9.3f')} {f(s, 'ms', '9.3f')} {f(t, 'ms', '8.3f')} {f(k, 'speedup_vs_sglang', '7.2f')} "
            f"{f(k, 'tflops', '5.0f')} {c['floor_ms']:8.3f} {100 * k.get('floor_fraction', float('nan')):5.0f}%"
        )
        if mma:
            fr = k.get("fraction_of", {})
            line += "".join(
                f" {100 * fr[key]:{w - 1}.0f}%" if key in fr else f" {'-':>{w}s}"
                for key, w in (("matmul_bf16", 7), ("mma_sync_raw", 5), ("mma_sync_ldmatrix", 5))
            )
        if gath:
            fr = k.get("fraction_of", {})
            line += f" {f(k, 'gather_tbps', '9.2f')}" + (
                f" {100 * fr['gather_l2']:4.0f}%" if "gather_l2" in fr else f" {'-':>5s}"
            )
        if fi:
            v = c["impls"].get("flashinfer", {})
            line += (
                f" {f(v, 'ms', '8.3f')} {f(k, 'speedup_vs_flashinfer', '6.2f')} {v.get('backend', 'error' if v else '-'):>10s}"
            )
        lines.append(line)
    if result.get("geomean_speedup_vs_sglang"):
        lines.append(f"geomean speedup over SGLang on {len(result['cases'])} cases: {result['geomean_speedup_vs_sglang']:.2f}x")
    if result.get("geomean_speedup_vs_flashinfer"):
        n = sum("speedup_vs_flashinfer" in c["impls"].get("kdtree", {}) for c in result["cases"])
        lines.append(
            f"geomean speedup over FlashInfer (causal, chain drafts) on {n} cases: {result['geomean_speedup_vs_flashinfer']:.2f}x"
        )
    return "\n".join(lines)


def save(result: dict, out_dir: Path) -> tuple[Path, Path]:
    from kdtree.plots import bench_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "bench.json"
    js.write_text(json.dumps(result, indent=1))
    png = out_dir / "bench.png"
    bench_figure(result).savefig(png, dpi=110, bbox_inches="tight")
    return js, png
