"""Where a verify step's time goes in a live server: SGLang's torch-profiler trace (`/start_profile`,
`/stop_profile`) read for its GPU kernels, attention's among them, set against the step's wall time.

What the GPU does not account for - the scheduler, NGRAM's matching on the host, the HTTP side - is the wall
time (measured without the profiler, which slows the host) less the GPU's busy time. The projection to a large model is Amdahl's law on the attention share: arithmetic,
not a measurement.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path

from kdtree.server.client import post_json

# SGLang's Triton attention kernels (extend: `_fwd_kernel`; decode: `_fwd_kernel_stage1/2`,
# `_fwd_grouped_kernel_stage1`) and kdtree's (forward, merge, the marshal kernel)
ATTENTION_RE = re.compile(r"_fwd_(grouped_)?kernel|extend_attention|decode_attention|verify_mla")


def load_trace(path: Path) -> dict:
    """A Chrome trace as torch's profiler writes it (`.json` or `.json.gz`)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def kernel_times(trace: dict) -> dict[str, float]:
    """GPU kernels by name: total microseconds."""
    out: dict[str, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel":
            out[e["name"]] = out.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    return out


def subtract(long: dict[str, float], short: dict[str, float]) -> dict[str, float]:
    """Kernel times of a long round less a short one's: what the extra steps cost (a kernel only the short round
    ran, such as a one-off, counts 0)."""
    return {n: max(0.0, t - short.get(n, 0.0)) for n, t in long.items()}


def step_profile(times: dict[str, float], steps: int, wall_ms_per_step: float | None = None, top: int = 8) -> dict:
    """Per verify step, from kernel times (µs) over `steps` steps: GPU busy time, attention's part of it, and
    (given the wall time) what the GPU does not account for."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    total = sum(times.values()) / 1e3 / steps
    attention = sum(t for n, t in times.items() if ATTENTION_RE.search(n)) / 1e3 / steps
    out = {
        "steps": steps,
        "gpu_ms_per_step": total,
        "attention_ms_per_step": attention,
        "attention_share_of_gpu": attention / total if total > 0 else None,
        "top_kernels": [
            {"name": n[:120], "ms_per_step": t / 1e3 / steps, "attention": bool(ATTENTION_RE.search(n))}
            for n, t in sorted(times.items(), key=lambda kv: -kv[1])[:top]
        ],
    }
    if wall_ms_per_step is not None:
        out["wall_ms_per_step"] = wall_ms_per_step
        out["attention_share_of_wall"] = attention / wall_ms_per_step if wall_ms_per_step > 0 else None
        out["not_on_gpu_ms_per_step"] = max(0.0, wall_ms_per_step - total)
    return out


def amdahl(share: float, speedup: float) -> float:
    """The whole step's speedup when a `share` of it runs `speedup` times faster (Amdahl's law)."""
    if not 0 <= share <= 1 or speedup <= 0:
        raise ValueError(f"share in [0, 1] and speedup > 0 (got {share}, {speedup})")
    return 1.0 / ((1.0 - share) + share / speedup)


def profiled(base_url: str, output_dir: Path, run) -> Path | None:
    """Run `run()` between SGLang's /start_profile and /stop_profile (GPU activity only, into `output_dir`); the
    trace it wrote (rank 0's above TP 1, once its size holds), or None."""
    output_dir.mkdir(parents=True, exist_ok=True)
    before = set(output_dir.rglob("*.json*"))
    post_json(base_url + "/start_profile", {"output_dir": str(output_dir), "activities": ["GPU"]}, 120.0)
    try:
        run()
    finally:
        post_json(base_url + "/stop_profile", {}, 120.0)
    deadline, sizes = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # the scheduler writes the trace after it answers
        new = sorted(set(output_dir.rglob("*.json*")) - before, key=lambda p: p.stat().st_mtime)
        ranked = [p for p in new if "-TP-" in p.name]  # above TP 1 a trace a rank: rank 0's (`...-TP-0.trace...`)
        picked = [p for p in ranked if re.search(r"-TP-0[-.]", p.name)] if ranked else new
        if picked:
            path, size = picked[-1], picked[-1].stat().st_size
            if size > 0 and sizes.get(path) == size:  # whole: its size held for a second
                return path
            sizes[path] = size
        time.sleep(1)
    return None
