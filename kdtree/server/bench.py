"""What kdtree buys a server (`kdtree bench --server`): output tokens/s and the verify step's time, kdtree serving
(`KDTREE_MODE=serve`) against SGLang's Triton backend (`KDTREE_MODE=triton`), both under SGLang's CUDA-graph
runner, with the same server settings, checkpoint and prompts, in one run.

Per point (prompt length, batch): each of the batch's prompts (distinct token ids of exactly that length) is sent
once with one new token, which prefills it into the radix cache; one untimed round follows (the first use of the
batch's shape builds what it needs); then pairs of rounds, all prompts at once, one decoding `short_tokens` and one
`short_tokens + new_tokens`. The pair's difference is decode alone - what both rounds pay once per request (the
extend of the last prompt token, HTTP, tokenization) cancels: tokens/s = extra tokens / extra time, the verify
step's time = extra time / extra verify steps of the batch (the most any of its requests took); the median of
`repeats` pairs is the point's. Timed over HTTP on loopback: the step time includes SGLang's scheduling and the
NGRAM drafter, as a user's server does. A profiled point's GPU time is the same difference of two traces.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from kdtree.errors import BadInput
from kdtree.server import client
from kdtree.server.check import CheckSettings, run_mode, write_json
from kdtree.server.checkpoint import TinySpec, build_checkpoint

BACKENDS = ("serve", "triton")  # kdtree serving, SGLang's Triton backend
OPTIONS = {"prompt_lens": "--prompt-len", "batches": "--batch", "draft_tokens": "--draft-tokens", "heads": "--heads"}


@dataclass(frozen=True)
class ServerBenchSettings:
    prompt_lens: tuple[int, ...] = (1024, 8192, 32768)
    batches: tuple[int, ...] = (1, 4, 16)
    draft_tokens: tuple[int, ...] = (16, 64)
    heads: tuple[int, ...] = (8, 16)  # per rank: Kimi K2.x at TP8, DeepSeek-V3 at TP8
    new_tokens: int = 256  # the long round decodes this many more than the short one
    short_tokens: int = 32
    repeats: int = 3
    layers: int = 4
    hidden_size: int = 256
    tp: int = 1  # --tp-size: each rank verifies its `heads` against its own KV pool
    # points (prompt length, batch) timed once more under SGLang's profiler, where a step's time goes; None: the
    # longest prompt at each batch up to 4
    profile_points: tuple[tuple[int, int], ...] | None = None

    @property
    def profiled(self) -> set[tuple[int, int]]:
        if self.profile_points is not None:
            return set(self.profile_points)
        return {(max(self.prompt_lens), b) for b in self.batches if b <= 4} or {(max(self.prompt_lens), min(self.batches))}

    def check(self) -> None:
        for name, option in OPTIONS.items():
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise BadInput(f"{option}: at least one value, each at least 1 (got {list(values)})")
        if self.tp < 1:
            raise BadInput(f"--tp must be at least 1, got {self.tp}")
        if min(self.draft_tokens) < 2 or self.new_tokens < 1 or self.short_tokens < 1 or self.repeats < 1:
            raise BadInput("draft tokens must be at least 2; new tokens, short tokens and repeats at least 1")

    @property
    def context_length(self) -> int:
        """Room for the longest prompt, its decode and a draft, rounded up to 1024."""
        need = max(self.prompt_lens) + self.short_tokens + self.new_tokens + max(self.draft_tokens) + 64
        return -(-need // 1024) * 1024

    def spec(self, heads: int) -> TinySpec:
        return TinySpec(
            heads_per_rank=heads,
            tp=self.tp,
            layers=self.layers,
            hidden_size=self.hidden_size,
            context_length=self.context_length,
        )

    def server(self, draft: int) -> CheckSettings:
        """The server settings both backends get (graphs for every batch size measured)."""
        bs = max(self.batches)
        tokens = bs * (max(self.prompt_lens) + self.short_tokens + self.new_tokens + 2 * draft) + 4096
        return CheckSettings(
            draft_tokens=draft,
            bfs_breadth=4,
            max_running_requests=bs,
            cuda_graph_max_bs=bs,
            cuda_graph_bs=tuple(sorted(set(self.batches))),
            max_total_tokens=tokens,
            mem_fraction_static=0.3,
            startup_timeout=600,
            request_timeout=900,
        )


def token_prompts(model_dir: Path, length: int, count: int, *, seed: int = 0) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids each, distinct from the first token on (no shared radix
    prefix between requests), repetitive within (NGRAM drafts from them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    body = tok.encode(" ".join(client.prompts(6, seed=seed)))
    out = []
    for i in range(count):
        ids = tok.encode(f"request {seed}-{i}: ") + body * (length // len(body) + 1)
        out.append(ids[:length])
    return out


@dataclass(frozen=True)
class Round:
    """One decode round of a point: every prompt at once, wall time, tokens and verify steps."""

    seconds: float
    tokens: int
    steps: int  # the most verify steps any request took: the batch's step count
    verify: int  # verify steps summed over the requests (accept length = tokens / verify)
    answered: int
    requests: int


def decode_round(url: str, prompts: list[list[int]], new_tokens: int, timeout: float) -> Round:
    t0 = time.perf_counter()
    replies = client.drive(url, prompts, concurrency=len(prompts), max_new_tokens=new_tokens, timeout=timeout)
    return Round(
        seconds=time.perf_counter() - t0,
        tokens=sum(r.completion_tokens for r in replies),
        steps=max((r.spec_verify_ct for r in replies), default=0),
        verify=sum(r.spec_verify_ct for r in replies),
        answered=sum(r.ok for r in replies),
        requests=len(replies),
    )


def difference(short: Round, long: Round) -> dict:
    """What the long round's extra tokens cost: the step time and tokens/s of decode alone (the request's
    extend of its last prompt token, HTTP and tokenization are in both rounds and cancel)."""
    dt, dsteps, dtokens, dverify = (
        long.seconds - short.seconds, long.steps - short.steps, long.tokens - short.tokens, long.verify - short.verify
    )  # fmt: skip
    ok = dt > 0 and dsteps > 0
    return {
        "seconds": dt,
        "tokens": dtokens,
        "verify_steps": dsteps,
        "tokens_per_s": dtokens / dt if ok else math.nan,
        "step_ms": 1e3 * dt / dsteps if ok else math.nan,
        "accept_length": dtokens / dverify if dverify > 0 else math.nan,
    }


def measure(url: str, prompts: list[list[int]], s: ServerBenchSettings, timeout: float) -> dict:
    """One point: prefill every prompt into the radix cache (one token each), one untimed round (the first use of
    this batch's shape), then `s.repeats` pairs of a short and a long round, each pair's difference taken; the
    median pair is the point's."""
    rounds = [decode_round(url, prompts, 1, timeout), decode_round(url, prompts, s.short_tokens, timeout)]
    pairs = []
    for _ in range(s.repeats):
        short = decode_round(url, prompts, s.short_tokens, timeout)
        long = decode_round(url, prompts, s.short_tokens + s.new_tokens, timeout)
        rounds += [short, long]
        pairs.append(difference(short, long))
    ranked = sorted(pairs, key=lambda d: (math.isnan(d["step_ms"]), d["step_ms"]))
    return ranked[len(ranked) // 2] | {
        "answered": sum(r.answered for r in rounds),
        "requests": sum(r.requests for r in rounds),
        "step_ms_each": [d["step_ms"] for d in pairs],
    }


def profile_point(
    url: str, prompts: list[list[int]], s: ServerBenchSettings, step_ms: float, trace_dir: Path, timeout: float
) -> dict | None:
    """A short and a long round once more, each under SGLang's profiler: per extra verify step, the GPU's busy time
    and attention's part of it; set against the unprofiled step time `step_ms`, what the GPU does not account for
    (`kdtree.server.profile`)."""
    from kdtree.server import profile

    traces, rounds = [], []
    for n, tag in ((s.short_tokens, "short"), (s.short_tokens + s.new_tokens, "long")):
        trace = profile.profiled(url, trace_dir / tag, lambda n=n: rounds.append(decode_round(url, prompts, n, timeout)))
        traces.append(trace)
    if None in traces or len(rounds) != 2 or rounds[1].steps <= rounds[0].steps:
        return None
    short, long = (profile.kernel_times(profile.load_trace(t)) for t in traces)
    steps = rounds[1].steps - rounds[0].steps
    return profile.step_profile(profile.subtract(long, short), steps, step_ms) | {"traces": [str(t) for t in traces]}


def pair_rows(rows: list[dict]) -> list[dict]:
    """kdtree's and Triton's rows of the same point side by side, with kdtree's gain in tokens/s and step time."""
    key = lambda r: (r["heads"], r["draft_tokens"], r["prompt_len"], r["batch"])  # noqa: E731
    by = {(key(r), r["backend"]): r for r in rows}
    out = []
    for k in sorted({key(r) for r in rows}):
        k_row, t_row = by.get((k, "serve")), by.get((k, "triton"))
        if k_row is None or t_row is None or not (k_row["tokens_per_s"] > 0 and t_row["tokens_per_s"] > 0):
            continue  # a point one side did not measure has no ratio
        out.append(
            dict(zip(("heads", "draft_tokens", "prompt_len", "batch"), k))
            | {
                "kdtree_tokens_per_s": k_row["tokens_per_s"],
                "triton_tokens_per_s": t_row["tokens_per_s"],
                "tokens_per_s_gain": k_row["tokens_per_s"] / t_row["tokens_per_s"],
                "kdtree_step_ms": k_row["step_ms"],
                "triton_step_ms": t_row["step_ms"],
                "step_speedup": t_row["step_ms"] / k_row["step_ms"],
                "kdtree_accept": k_row["accept_length"],
                "triton_accept": t_row["accept_length"],
            }
            | _where_time_goes(k_row.get("profile"), t_row.get("profile"))
        )
    return out


def _where_time_goes(kdtree_profile: dict | None, triton_profile: dict | None) -> dict:
    """For a profiled point: attention's share of Triton's step, the attention speedup inside the server, and
    what Amdahl's law makes of them (the projection is arithmetic)."""
    if not isinstance(kdtree_profile, dict) or not isinstance(triton_profile, dict):
        return {}
    if kdtree_profile.get("attention_ms_per_step") is None or triton_profile.get("attention_ms_per_step") is None:
        return {}  # a trace without its kernels (or a file's profile cut short)
    from kdtree.server.profile import amdahl

    share = triton_profile.get("attention_share_of_wall")
    k_att, t_att = kdtree_profile["attention_ms_per_step"], triton_profile["attention_ms_per_step"]
    speedup = t_att / k_att if k_att > 0 else None
    return {
        "triton_attention_ms": t_att,
        "kdtree_attention_ms": k_att,
        "triton_attention_share": share,
        "attention_speedup": speedup,
        "triton_not_on_gpu_ms": triton_profile.get("not_on_gpu_ms_per_step"),
        "kdtree_not_on_gpu_ms": kdtree_profile.get("not_on_gpu_ms_per_step"),
        "amdahl_step_speedup": amdahl(share, speedup) if share is not None and speedup else None,
    }


def format_table(pairs: list[dict]) -> str:
    """The pairs as a markdown table."""
    head = (
        "| heads | draft | prompt | batch | kdtree tok/s | Triton tok/s | x | kdtree step ms | Triton step ms | x | accept k / T |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {p['heads']} | {p['draft_tokens']} | {p['prompt_len']} | {p['batch']} | {p['kdtree_tokens_per_s']:.0f} | "
        f"{p['triton_tokens_per_s']:.0f} | {p['tokens_per_s_gain']:.2f}x | {p['kdtree_step_ms']:.2f} | {p['triton_step_ms']:.2f} | "
        f"{p['step_speedup']:.2f}x | {p['kdtree_accept']:.2f} / {p['triton_accept']:.2f} |"
        for p in pairs
    ]
    return "\n".join([head, *lines])


def run(
    s: ServerBenchSettings,
    out_dir: Path,
    *,
    say: Callable[[str], None] = lambda _: None,
    model_root: Path | None = None,
    launcher: Callable[[int], list[str]] | None = None,
) -> dict:
    """Every (heads, draft tokens) server, kdtree then Triton, every point on each; the result is written to
    `out_dir/bench-server.json` after each server. `launcher` replaces SGLang's command line (`run_mode`)."""
    s.check()
    out_dir.mkdir(parents=True, exist_ok=True)
    from kdtree.environment import describe

    result = {"settings": asdict(s), "environment": describe(), "rows": [], "servers": [], "pairs": [], "problems": []}
    for heads in s.heads:
        spec = s.spec(heads)
        model = build_checkpoint(spec, (model_root or out_dir) / f"model-h{heads}-c{spec.context_length}")
        prompts = {(n, b): token_prompts(model, n, b, seed=n + b) for n in s.prompt_lens for b in s.batches}
        for draft in s.draft_tokens:
            cs = s.server(draft)
            for backend in BACKENDS:
                rows = []

                def traffic(url, heads=heads, draft=draft, backend=backend, rows=rows):
                    for (n, b), ids in prompts.items():
                        say(f"{backend} h{heads} n{draft}: prompt {n}, batch {b}")
                        m = measure(url, ids, s, cs.request_timeout)
                        if (n, b) in s.profiled and m["step_ms"] > 0:
                            say(f"{backend} h{heads} n{draft}: prompt {n}, batch {b}, profiled")
                            m["profile"] = profile_point(
                                url,
                                ids,
                                s,
                                m["step_ms"],
                                out_dir / "traces" / f"{backend}-h{heads}-n{draft}-{n}x{b}",
                                cs.request_timeout,
                            )
                        rows.append({"heads": heads, "draft_tokens": draft, "backend": backend, "prompt_len": n, "batch": b} | m)
                    return []

                name = f"bench-{backend}-h{heads}-n{draft}"
                r = run_mode(
                    backend,
                    model,
                    spec,
                    replace(cs, modes=(backend,)),
                    out_dir,
                    name=name,
                    requests=traffic,
                    say=say,
                    launcher=launcher,
                )
                result["rows"] += rows
                result["servers"].append(
                    {"name": name, "log": r.log, "ready_after": r.ready_after, "scan": r.scan, "reasons": r.reasons}
                )
                missing = len(prompts) - len(rows)
                unanswered = sum(row["requests"] - row["answered"] for row in rows)
                result["problems"] += [f"{name}: {why}" for why in r.reasons if "requests not answered" not in why]
                if missing or unanswered:
                    result["problems"].append(f"{name}: {missing} point(s) not measured, {unanswered} request(s) not answered")
                result |= derived(result["rows"], s.layers)
                write_json(out_dir / "bench-server.json", result)
    return result


def derived(rows: list[dict], layers: int) -> dict:
    """What a result computes from its rows: the pairs, and the projections of the profiled ones."""
    from kdtree.server.projection import projections

    pairs = pair_rows(rows)
    return {"pairs": pairs, "projections": projections(pairs, layers)}


ROW_KEYS = ("heads", "draft_tokens", "backend", "prompt_len", "batch", "tokens_per_s", "step_ms", "accept_length")


def merge(results: list[tuple[str, dict]]) -> dict:
    """Results of runs over other heads or draft tokens (`kdtree bench --server --from`, e.g. one device call
    each) as one: their rows, servers and problems, the pairs and projections computed again. Runs must share
    the model (layers, hidden size, TP), the rounds and the GPU, and a point measured twice is refused."""
    if not results:
        raise BadInput("--from: at least one bench-server.json")
    shape, gpu = None, None
    rows, servers, problems, seen = [], [], [], {}
    for where, r in results:
        if not (isinstance(r, dict) and isinstance(r.get("settings"), dict) and isinstance(r.get("rows"), list)):
            raise BadInput(f"--from {where}: not a `kdtree bench --server` result (no settings and rows)")
        st = r["settings"]
        this = {k: st.get(k) for k in ("layers", "hidden_size", "new_tokens", "short_tokens")} | {"tp": st.get("tp", 1)}
        if not (isinstance(this["layers"], int) and this["layers"] >= 1):
            raise BadInput(f"--from {where}: settings.layers must be a whole number >= 1, got {this['layers']!r}")
        if shape is not None and this != shape:
            raise BadInput(f"--from {where}: settings {this} differ from the first file's {shape}")
        shape = this
        env = r.get("environment") or {}
        if env.get("gpu") and gpu and env["gpu"] != gpu:
            raise BadInput(f"--from {where}: measured on {env['gpu']}, the first file on {gpu}: runs of two GPUs do not merge")
        gpu = gpu or env.get("gpu")
        for i, row in enumerate(r["rows"]):
            missing = [k for k in ROW_KEYS if not isinstance(row, dict) or k not in row]
            if missing:
                raise BadInput(f"--from {where}: rows[{i}] lacks {', '.join(missing)}")
            key = tuple(row[k] for k in ("heads", "draft_tokens", "backend", "prompt_len", "batch"))
            if key in seen:
                raise BadInput(f"--from {where}: point {key} is also in {seen[key]}")
            seen[key] = where
            rows.append(row)
        servers += r.get("servers", [])
        problems += r.get("problems", [])
    grid = {
        name: sorted({row[key] for row in rows})
        for name, key in (
            ("heads", "heads"),
            ("draft_tokens", "draft_tokens"),
            ("prompt_lens", "prompt_len"),
            ("batches", "batch"),
        )
    }
    settings = results[0][1]["settings"] | grid | {"merged_from": [w for w, _ in results]}
    environment = next((r.get("environment") for _, r in results if r.get("environment")), None)
    merged = {"settings": settings, "environment": environment, "rows": rows, "servers": servers, "problems": problems}
    return merged | derived(rows, shape["layers"])
