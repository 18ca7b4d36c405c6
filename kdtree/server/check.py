"""`kdtree server-check`: a real SGLang server with `--attention-backend kdtree` and NGRAM tree speculation, on
loopback, over a tiny random checkpoint, in each mode a user relies on:

| mode | KDTREE_MODE | CUDA graphs | passes when |
|---|---|---|---|
| `shadow` | shadow | off | every request answered; shadow lines printed, every rel <= tolerance, no NaN; no fallback |
| `serve` | serve | SGLang's runner | every request answered; target-verify graphs captured; kdtree served and its graphs replayed; no fallback |
| `capture` | capture | off | every request answered; capture files written (0600), each validates and diffs clean against the output SGLang served and the fp64 oracle |
| `triton` | triton | SGLang's runner | every request answered (a baseline: not in the default set) |

Each mode is one server: started in its own process group, ended with the whole group on every path.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kdtree.diff import DEFAULT_TOLERANCE  # captures diff as `kdtree diff` does
from kdtree.environment import describe
from kdtree.errors import BadInput
from kdtree.files import write_text_atomic
from kdtree.server import client, logscan
from kdtree.server.checkpoint import TinySpec, build_checkpoint
from kdtree.server.process import ServerError, ServerProcess, free_port

MODES = {"shadow": ("shadow", False), "serve": ("serve", True), "capture": ("capture", False), "triton": ("triton", True)}
DEFAULT_MODES = ("shadow", "serve", "capture")
ENTRYPOINTS = ("launch_server", "serve")


@dataclass(frozen=True)
class CheckSettings:
    """How the servers run and what they are sent (the defaults are what a first check needs)."""

    modes: tuple[str, ...] = DEFAULT_MODES
    draft_tokens: int = 16  # --speculative-num-draft-tokens
    bfs_breadth: int = 4  # --speculative-ngram-max-bfs-breadth (1: chains)
    page_size: int = 1
    requests: int = 8
    concurrency: int = 4
    max_new_tokens: int = 64
    prompt_chars: int = 0  # grow each prompt to at least this many characters
    max_running_requests: int = 4
    cuda_graph_max_bs: int = 4
    cuda_graph_bs: tuple[int, ...] = ()  # exactly these batch sizes captured (instead of 1..cuda_graph_max_bs)
    mem_fraction_static: float = 0.15
    max_total_tokens: int = 262144
    tolerance: float = 5e-3  # shadow rel
    capture_every: int = 5
    capture_max_files: int = 16
    startup_timeout: float = 600.0
    request_timeout: float = 600.0
    entrypoint: str = "launch_server"
    seed: int = 0
    extra_args: tuple[str, ...] = ()  # more server flags, as given

    def check(self) -> None:
        """Raise BadInput naming the setting that cannot run."""
        for m in self.modes:
            if m not in MODES:
                raise BadInput(f"--mode: unknown mode {m!r}; expected one of {', '.join(MODES)}")
        if not self.modes:
            raise BadInput("--mode: at least one mode")
        if len(set(self.modes)) != len(self.modes):
            raise BadInput(f"--mode: each mode once (got {', '.join(self.modes)})")
        if not (self.startup_timeout > 0 and self.request_timeout > 0):
            raise BadInput(f"--startup-timeout must be > 0 seconds, got {self.startup_timeout}")
        if self.entrypoint not in ENTRYPOINTS:
            raise BadInput(f"--entrypoint: one of {', '.join(ENTRYPOINTS)}, got {self.entrypoint!r}")
        for name in ("draft_tokens", "bfs_breadth", "page_size", "requests", "concurrency", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.draft_tokens < 2:
            raise BadInput(f"--draft-tokens must be at least 2 (a verify step drafts), got {self.draft_tokens}")
        if self.bfs_breadth > 1 and self.page_size > 1:
            raise BadInput("--page-size above 1 needs --bfs-breadth 1: SGLang refuses trees (topk > 1) on pages")
        if not 0 < self.tolerance:
            raise BadInput(f"--tolerance must be > 0, got {self.tolerance}")
        if not 0 < self.mem_fraction_static < 1:
            raise BadInput(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")


def server_argv(model_dir: Path, port: int, s: CheckSettings, spec: TinySpec, mode: str) -> list[str]:
    """The server's command line: SGLang's launcher (or `sglang serve`) with kdtree and NGRAM on loopback."""
    graphs = MODES[mode][1]
    if s.entrypoint == "serve":
        head = [sys.executable, "-c", "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; main()", "serve"]
    else:
        head = [sys.executable, "-m", "sglang.launch_server"]
    argv = head + [
        "--model-path", str(model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", str(spec.tp),
        "--attention-backend", "kdtree",
        "--speculative-algorithm", "NGRAM",
        "--speculative-num-draft-tokens", str(s.draft_tokens),
        "--speculative-ngram-max-bfs-breadth", str(s.bfs_breadth),
        "--page-size", str(s.page_size),
        "--max-running-requests", str(s.max_running_requests),
        "--mem-fraction-static", str(s.mem_fraction_static),
        "--max-total-tokens", str(s.max_total_tokens),
        "--context-length", str(spec.context_length),
        "--grammar-backend", "none",
        "--sampling-backend", "pytorch",
        "--log-level", "info",
        "--random-seed", str(s.seed),
    ]  # fmt: skip
    # prefill graphs are not what this checks; decode graphs are SGLang's target-verify runner (0.5.23 deprecates
    # --disable-cuda-graph for these per-phase switches)
    argv += ["--cuda-graph-backend-prefill", "disabled"]
    if graphs and s.cuda_graph_bs:
        argv += ["--cuda-graph-bs-decode", *map(str, s.cuda_graph_bs)]
    elif graphs:
        argv += ["--cuda-graph-max-bs-decode", str(s.cuda_graph_max_bs)]
    else:
        argv += ["--cuda-graph-backend-decode", "disabled"]
    return argv + list(s.extra_args)


def server_env(mode: str, s: CheckSettings, capture_dir: Path, base: dict | None = None, *, tp: int = 1) -> dict:
    """The server's environment: the caller's, plus kdtree's mode and what an offline SGLang 0.5.23 needs; above
    TP 1 every rank prints and captures (`KDTREE_RANKS=all`) unless the caller chose. NCCL's settings are the
    caller's, passed on as they are."""
    env = dict(os.environ if base is None else base)
    if tp > 1:
        env.setdefault("KDTREE_RANKS", "all")
    env.update({"KDTREE_MODE": MODES[mode][0], "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if mode == "capture":
        env.update(
            {
                "KDTREE_CAPTURE_DIR": str(capture_dir),
                "KDTREE_EVERY": str(s.capture_every),
                "KDTREE_CAPTURE_MAX_FILES": str(s.capture_max_files),
            }
        )
    # SGLang's Rust radix-tree core panicked at the first prefill on an H100 (UnknownKind(20)); the Python
    # one is SGLang's own alternative. A value the caller set wins.
    env.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    cuda_home = env.setdefault("CUDA_HOME", "/usr/local/cuda")  # SGLang JIT-compiles a few kernels with nvcc and ninja
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), f"{cuda_home}/bin", env.get("PATH", "")])
    return env


SGL_KERNEL_PROBE = """
import importlib.metadata as md, importlib.util as u, json
s = u.find_spec("sgl_kernel")
out = {"route": "absent"}
if s is not None and s.origin:
    try: v = md.version("sglang-kernel")
    except md.PackageNotFoundError: v = None
    out = {"route": "sgl_kernel", "path": s.origin, "version": v}
elif s is not None:
    out = {"route": "stand-in", "path": None, "version": None}
print(json.dumps(out))
"""


def sgl_kernel_route(env: dict) -> dict:
    """Which sgl_kernel the server's processes import: the real package, a stand-in (a module without a file,
    e.g. the test harness's), or none."""
    r = subprocess.run([sys.executable, "-c", SGL_KERNEL_PROBE], env=env, capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"route": "unknown", "error": (r.stderr or r.stdout)[-500:]}


@dataclass
class ModeResult:
    mode: str
    passed: bool = False
    reasons: list[str] = field(default_factory=list)  # why it failed (empty when it passed)
    seconds: float = 0.0
    ready_after: float | None = None
    log: str = ""
    requests: int = 0
    answered: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0  # SGLang's spec_verify_ct, summed over requests
    accept_length: float | None = None  # completion tokens / verify steps
    openai: dict = field(default_factory=dict)
    scan: dict = field(default_factory=dict)
    captures: list[dict] = field(default_factory=list)
    stopped: dict = field(default_factory=dict)
    replies: list[dict] = field(default_factory=list)


def _capture_checks(capture_dir: Path, tolerance: float) -> list[dict]:
    """Each capture file: its mode bits, whether it validates, its trees, and diffs of the kernel (its torch
    model without a GPU) against the stored output and the fp64 oracle."""
    from kdtree.capture import CaptureError, load
    from kdtree.impls import default_impl, diff_capture
    from kdtree.info import summarize

    impl = default_impl()
    out = []
    for path in sorted(capture_dir.glob("*.safetensors")):
        row = {"path": str(path), "mode": oct(stat.S_IMODE(path.stat().st_mode)), "impl": impl}
        try:
            cap = load(path)
        except CaptureError as e:
            out.append(row | {"valid": False, "error": str(e)})
            continue
        info = summarize(cap)
        row |= {
            "valid": True,
            "batch_size": info["batch_size"],
            "prefix_lens": info["prefix_lens"],
            "num_draft": info["num_draft"],
            "tp_rank": cap.meta.tp_rank,
            "max_branching": max(r["max_branching"] for r in info["requests"]),
            # a node below the root with two children: a tree, not a chain with NGRAM's padding at the root
            "branches_below_root": any(r["max_branching_below_root"] > 1 for r in info["requests"]),
            "trees": [(r["depth"], r["max_branching"], r["max_branching_below_root"]) for r in info["requests"]],
        }
        for ref in ("capture", "oracle"):
            diffs = diff_capture(cap, impl, ref, tolerance=tolerance)
            row[f"rel_vs_{ref}"] = max(d.rel for d in diffs)
            row[f"passed_vs_{ref}"] = all(d.passed for d in diffs)
        out.append(row)
    return out


def cleanup_problems(stopped: dict) -> list[str]:
    """What stopping the server left behind (checked on every path, a server that never answered too)."""
    why = []
    if stopped.get("group_left"):
        why.append("server processes were left after stopping")
    if stopped.get("stopped") and stopped.get("port_free") is False:
        why.append("the server's port was still taken after stopping")
    return why


def verdict(r: ModeResult, s: CheckSettings, tp: int = 1) -> list[str]:
    """Why a mode's run fails the check (empty: it passes); above TP 1, shadow lines and captures from every
    rank."""
    why = []
    ranks = set(range(tp))
    if r.answered < r.requests:
        why.append(f"{r.requests - r.answered} of {r.requests} requests not answered")
    why += [f"{path} did not answer" for path, ok in r.openai.items() if not ok]
    scan = r.scan
    if scan.get("fallbacks"):
        why.append(f"kdtree fell back: {scan['fallbacks'][0]}")
    if r.mode == "shadow":
        if not scan.get("shadow_lines"):
            why.append("no shadow line in the log")
        elif scan["worst_rel"] is None or scan["worst_rel"] > s.tolerance:
            why.append(f"worst shadow rel {scan['worst_rel']} > {s.tolerance}")
        if scan.get("nonfinite"):
            why.append(f"{scan['nonfinite']} non-finite values in kdtree's output")
        missing = ranks - set(scan.get("shadow_ranks") or ())
        if scan.get("shadow_lines") and missing:
            why.append(f"no shadow line from TP rank {', '.join(map(str, sorted(missing)))} (KDTREE_RANKS=all prints all)")
    if MODES[r.mode][1]:
        if not scan.get("graph_batch_sizes"):
            why.append("no target-verify CUDA graph captured (SGLang's log has no 'Capture target verify CUDA graph end')")
    if r.mode == "serve":
        if not scan.get("kdtree_served"):
            why.append("kdtree served no verify step")
        if not scan.get("kdtree_graph_replayed"):
            why.append("no CUDA graph kdtree captured was replayed")
    if r.mode == "capture":
        if not r.captures:
            why.append("no capture file written")
        for c in r.captures:
            name = Path(c["path"]).name
            if not c.get("valid"):
                why.append(f"{name} does not validate: {c.get('error')}")
            elif not (c.get("passed_vs_capture") and c.get("passed_vs_oracle")):
                why.append(f"{name} diffs outside rel {DEFAULT_TOLERANCE}")
            if c["mode"] != "0o600":
                why.append(f"{name} has mode {c['mode']}, not 0o600")
        written = {c["tp_rank"] for c in r.captures if c.get("valid")}
        if r.captures and ranks - written:
            why.append(f"no capture file from TP rank {', '.join(map(str, sorted(ranks - written)))}")
    return why


def run_mode(
    mode: str,
    model_dir: Path,
    spec: TinySpec,
    s: CheckSettings,
    out_dir: Path,
    *,
    say: Callable[[str], None] = lambda _: None,
    texts: list[str] | None = None,
    launcher: Callable[[int], list[str]] | None = None,
    name: str | None = None,
    env: dict | None = None,
    requests: Callable[[str], list[client.Reply]] | None = None,
) -> ModeResult:
    """One server in `mode`: start, wait, send the prompts, stop, read its log (and its captures).

    `name` names its log and capture folder (default: the mode); `env` adds to the server's environment;
    `requests` (the server's URL -> replies) replaces the default traffic; `launcher` (port -> command line)
    replaces SGLang's command line (tests run a stand-in server)."""
    t0 = time.monotonic()
    name = name or mode
    log_path = out_dir / f"{name}.log"
    capture_dir = out_dir / ("captures" if name == mode else f"captures-{name}")
    if mode == "capture" and capture_dir.exists():
        shutil.rmtree(capture_dir)
    result = ModeResult(mode, log=str(log_path))
    port = free_port()
    texts = texts if texts is not None else client.prompts(s.requests, seed=s.seed, min_chars=s.prompt_chars)
    argv = launcher(port) if launcher is not None else server_argv(model_dir, port, s, spec, mode)
    server = ServerProcess(argv, port=port, log_path=log_path, env=server_env(mode, s, capture_dir, tp=spec.tp) | dict(env or {}))
    try:
        with server:
            say(f"{name}: starting the server (port {port})")
            result.ready_after = server.wait_ready(
                s.startup_timeout, lambda t: say(f"{name}: waiting for the server ({t:.0f} s)")
            )
            say(f"{name}: greedy requests")
            if requests is not None:
                replies = requests(server.url)
            else:
                replies = client.drive(
                    server.url, texts, concurrency=s.concurrency, max_new_tokens=s.max_new_tokens, timeout=s.request_timeout
                )
                result.openai = client.openai_probe(server.url)
            say(f"{name}: stopping the server")
    except ServerError as e:
        result.reasons.append(str(e))
        replies = []
    result.stopped = server.stopped or {}
    result.requests = len(replies) if requests is not None else len(texts)
    result.replies = [r.to_json() for r in replies]
    result.answered = sum(r.ok for r in replies)
    result.completion_tokens = sum(r.completion_tokens for r in replies)
    result.verify_steps = sum(r.spec_verify_ct for r in replies)
    result.accept_length = result.completion_tokens / result.verify_steps if result.verify_steps else None
    result.scan = logscan.scan(log_path.read_text(errors="replace") if log_path.exists() else "").summary()
    if mode == "capture" and capture_dir.exists():
        say("capture: validating and diffing the captures")
        result.captures = _capture_checks(capture_dir, DEFAULT_TOLERANCE)
    if not result.reasons:  # a server that never came up has no further verdict ...
        result.reasons = verdict(result, s, spec.tp)
    result.reasons += cleanup_problems(result.stopped)  # ... but its clean-up has
    result.passed = not result.reasons
    result.seconds = time.monotonic() - t0
    return result


def write_json(path: Path, obj) -> None:
    """Write atomically (temporary file, rename): a report is whole or absent."""
    write_text_atomic(path, json.dumps(obj, indent=1, default=str))


def run_check(
    spec: TinySpec,
    s: CheckSettings,
    out_dir: Path,
    *,
    model_dir: Path | None = None,
    say: Callable[[str], None] = lambda _: None,
    on_mode: Callable[[ModeResult], None] = lambda _: None,
    launcher: Callable[[int], list[str]] | None = None,
) -> dict:
    """Build (or reuse) the checkpoint, run each mode, write `out_dir/report.json`; the report."""
    spec.check()
    s.check()
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir or out_dir / "model"
    report = {
        "passed": False,
        "complete": False,
        "spec": asdict(spec),
        "settings": asdict(s),
        "environment": describe(),
        "modes": {},
    }
    try:
        say(f"building the tiny checkpoint in {model_dir}")
        build_checkpoint(spec, model_dir)
        report["model_dir"] = str(model_dir)
        report["sgl_kernel"] = sgl_kernel_route(server_env(s.modes[0], s, out_dir / "captures", tp=spec.tp))
        for mode in s.modes:
            r = run_mode(mode, model_dir, spec, s, out_dir, say=say, launcher=launcher)
            report["modes"][mode] = asdict(r)
            write_json(out_dir / "report.json", report)
            on_mode(r)
        report["complete"] = True
        report["passed"] = all(m["passed"] for m in report["modes"].values())
    finally:
        report["seconds"] = time.monotonic() - t0
        write_json(out_dir / "report.json", report)
    return report
