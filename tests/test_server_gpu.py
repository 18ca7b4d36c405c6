"""A real SGLang server (`sglang.launch_server`, SGLang 0.5.23) with `--attention-backend kdtree` and NGRAM
speculation, over the tiny random DeepSeek-V3-architecture checkpoint (`kdtree.server.checkpoint`), on loopback.
Each test starts its own servers through `kdtree.server.check.run_mode` and ends them with their process group.

Needs a CUDA GPU, CuPy and SGLang. sgl_kernel is either the real package or kdtree's test stand-in
(tests/sglang_harness/site on PYTHONPATH, with SGLANG_FORCE_FUSED_OP_BACKEND=torch and
SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1); the route that ran is printed in the header and written to
`route.json`. Logs, reports and captures go to KDTREE_SERVER_TEST_OUT (default: pytest's temporary folder).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kdtree.server import check, client
from kdtree.server.checkpoint import TinySpec, build_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (pip install -e '.[sglang]')"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy"),
]

SPEC = TinySpec(layers=4, heads_per_rank=8, context_length=8192)
BASE = check.CheckSettings(max_running_requests=8, cuda_graph_max_bs=4, startup_timeout=300, request_timeout=300)
TOL = 5e-3


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    d = Path(os.environ.get("KDTREE_SERVER_TEST_OUT") or tmp_path_factory.mktemp("server"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def model(out) -> Path:
    return build_checkpoint(SPEC, out / "model")


@pytest.fixture(scope="module", autouse=True)
def route(out, model):
    """Which sgl_kernel the servers import: printed and kept beside the logs."""
    r = check.sgl_kernel_route(check.server_env("serve", BASE, out))
    (out / "route.json").write_text(json.dumps(r))
    print(f"\nsgl_kernel route: {r}")
    return r


def waves(base_url: str, texts: list[str], widths: tuple[int, ...], max_new_tokens: int) -> list[client.Reply]:
    """The prompts in waves of `widths` concurrent requests (batches of those sizes)."""
    replies, i = [], 0
    while i < len(texts):
        for w in widths:
            chunk = texts[i : i + w]
            replies += client.drive(base_url, chunk, concurrency=w, max_new_tokens=max_new_tokens, first_index=i)
            i += w
            if i >= len(texts):
                break
    return replies


def fallback_lines(log: str, mark: str) -> list[str]:
    return [line for line in Path(log).read_text(errors="replace").splitlines() if "[kdtree]" in line and mark in line]


def test_shadow_lines_over_many_verify_steps_stay_within_tolerance(model, out):
    """Varied prompts (a third share an opening: radix-cache hits), batches of 1 to 8, a client that leaves
    mid-generation and a burst of 64 requests over --max-running-requests 8: every request answered, >= 500
    shadow lines over >= 50 verify steps, every rel <= 5e-3, no NaN, no fallback."""
    texts = client.prompts(40, seed=1)

    def traffic(url):
        replies = waves(url, texts, (1, 2, 4, 8), max_new_tokens=96)
        assert client.cancel_midway(url, texts[0], max_new_tokens=256) >= 1
        burst = client.prompts(64, seed=2)
        replies += client.drive(url, burst, concurrency=64, max_new_tokens=24)
        return replies

    r = check.run_mode("shadow", model, SPEC, BASE, out, name="shadow", requests=traffic)
    (out / "shadow.json").write_text(json.dumps(r.__dict__, default=str, indent=1))
    assert r.answered == r.requests == 104, r.reasons
    scan = r.scan
    assert scan["shadow_lines"] >= 500 and scan["shadow_lines"] // SPEC.layers >= 50, scan["shadow_lines"]
    assert scan["shadow_layers"] == list(range(SPEC.layers))
    assert scan["worst_rel"] <= TOL and scan["nonfinite"] == 0
    assert scan["fallbacks"] == [] and r.passed, r.reasons


def test_serve_under_cuda_graphs_agrees_with_triton(model, out):
    """>= 100 requests to kdtree under SGLang's CUDA-graph runner, in batches below and above the captured sizes
    (1-4 replayed, 5-8 eager), against a KDTREE_MODE=triton server given the same prompts one at a time: all
    answered, greedy tokens agree >= 95 %, accept lengths the same within noise."""
    texts = client.prompts(104, seed=3)
    served = check.run_mode(
        "serve", model, SPEC, BASE, out, name="serve", requests=lambda url: waves(url, texts, (1, 3, 4, 6, 8), 32)
    )
    triton = check.run_mode(
        "triton",
        model,
        SPEC,
        BASE,
        out,
        name="triton",
        requests=lambda url: client.drive(url, texts, concurrency=1, max_new_tokens=32),
    )
    for r in (served, triton):
        assert r.answered == r.requests == len(texts), r.reasons
        assert r.scan["graph_batch_sizes"] == [1, 2, 3, 4]
    assert served.passed, served.reasons  # kdtree served, its graphs replayed, no fallback
    a = {x["prompt_index"]: x for x in served.replies}
    b = {x["prompt_index"]: x for x in triton.replies}
    assert sorted(a) == sorted(b) == list(range(len(texts)))
    same = sum(x == y for i in a for x, y in zip(a[i]["output_ids"], b[i]["output_ids"]))
    total = sum(len(b[i]["output_ids"]) for i in b)
    agreement = same / total
    (out / "serve-vs-triton.json").write_text(
        json.dumps({"agreement": agreement, "accept": [served.accept_length, triton.accept_length]}, indent=1)
    )
    print(
        f"\ngreedy tokens agree {agreement:.4f}; accept length kdtree {served.accept_length:.3f} triton {triton.accept_length:.3f}"
    )
    assert agreement >= 0.95
    assert abs(served.accept_length - triton.accept_length) <= 0.1 * triton.accept_length


@pytest.mark.parametrize("draft", [16, 64])
def test_ngram_trees_branch_and_their_captures_diff_clean(model, out, draft):
    """NGRAM with BFS breadth 8 on prompts whose n-grams branch drafts trees: capture files (layer 0, every
    third step, a budget of 10 files) validate, are 0600, diff clean against the capture and the oracle, and some
    tree branches below its root (NGRAM pads a short draft with children of the root, so a branch there proves
    nothing); capture stops at the budget and serving goes on."""
    s = replace(BASE, draft_tokens=draft, bfs_breadth=8, capture_every=3, capture_max_files=10)
    s = replace(s, extra_args=("--speculative-ngram-min-bfs-breadth", "2"))
    texts = client.branching_prompts(16, seed=draft)
    name = f"capture-n{draft}"
    r = check.run_mode(
        "capture", model, SPEC, s, out, name=name, env={"KDTREE_LAYERS": "0"},
        requests=lambda url: waves(url, texts, (1, 4), max_new_tokens=48),
    )  # fmt: skip
    (out / f"{name}.json").write_text(json.dumps(r.__dict__, default=str, indent=1))
    assert r.answered == r.requests == len(texts), r.reasons
    assert len(r.captures) == 10 and r.scan["capture_budget_stops"], r.scan
    for c in r.captures:
        assert c["valid"] and c["mode"] == "0o600" and c["passed_vs_capture"] and c["passed_vs_oracle"], c
        assert c["num_draft"] == [draft]
    assert any(c["branches_below_root"] for c in r.captures), [c["trees"] for c in r.captures]
    assert r.passed, r.reasons


def test_page_size_16_is_served(model, out):
    """--page-size 16 (chains: SGLang refuses trees on pages for this backend): kdtree serves, under graphs."""
    s = replace(BASE, page_size=16, bfs_breadth=1)
    r = check.run_mode("serve", model, SPEC, s, out, name="serve-page16")
    assert r.answered == r.requests and r.passed, r.reasons


def test_chains_on_pages_of_16_are_captured_and_diff_clean(model, out):
    """Capture mode with --page-size 16 and BFS breadth 1, one request at a time: the files validate, are 0600 and
    diff clean against the capture and the oracle, and a later step's draft is a whole chain (every node one child:
    SGLang pads a short n-gram match with children of the root, so a chain needs a match as deep as the draft,
    which the random model's greedy loops give once its own output fills the n-gram table); one is kept for data/."""
    s = replace(BASE, page_size=16, bfs_breadth=1, requests=4, concurrency=1, max_new_tokens=200)
    s = replace(s, capture_every=8, capture_max_files=6)
    name = "capture-chain-page16"
    r = check.run_mode("capture", model, SPEC, s, out, name=name, env={"KDTREE_LAYERS": "0"})
    (out / f"{name}.json").write_text(json.dumps(r.__dict__, default=str, indent=1))
    assert r.answered == r.requests and 4 <= len(r.captures) <= 6, r.reasons  # (steps: 200 tokens / accept, x 4)
    for c in r.captures:
        assert c["valid"] and c["mode"] == "0o600" and c["passed_vs_capture"] and c["passed_vs_oracle"], c
        assert c["num_draft"] == [16], c
    assert any(c["max_branching"] == 1 for c in r.captures), [c["trees"] for c in r.captures]
    assert r.passed, r.reasons


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP 2 needs two GPUs")
def test_at_tp_2_both_ranks_shadow_serve_and_capture(out):
    """`--tp-size 2` over a 16-head checkpoint (8 heads a rank, as Kimi K2.x at TP8): every rank prints shadow
    lines within tolerance and writes captures that validate and diff clean (`KDTREE_RANKS=all`); serve runs under
    CUDA graphs with every request answered. NCCL's settings are the machine's, passed on."""
    spec = replace(SPEC, tp=2)
    model = build_checkpoint(spec, out / "model-tp2")
    for mode in ("shadow", "serve", "capture"):
        r = check.run_mode(mode, model, spec, BASE, out, name=f"tp2-{mode}", env={"KDTREE_LAYERS": "0,1"})
        (out / f"tp2-{mode}.json").write_text(json.dumps(r.__dict__, default=str, indent=1))
        assert r.answered == r.requests and r.passed, r.reasons
        if mode == "shadow":
            assert r.scan["shadow_ranks"] == [0, 1] and r.scan["worst_rel"] <= TOL
        if mode == "capture":
            assert {Path(c["path"]).name.split("-")[2] for c in r.captures} == {"tp0", "tp1"}  # step-L-tp-run tag


def _cupy_blocked(tmp: Path) -> str:
    """A folder that, first on PYTHONPATH, makes `import cupy` fail as on a machine without CuPy."""
    (tmp / "cupy").mkdir(parents=True, exist_ok=True)
    (tmp / "cupy" / "__init__.py").write_text("raise ImportError('No module named cupy (blocked by the test)')\n")
    return str(tmp)


def _corrupt_verdict_cache(tmp: Path) -> str:
    """A cache folder whose verdict for this GPU, driver and kernel source is malformed (`passed: false` with no
    rows: the file that once raised out of the backend's constructor, so SGLang did not start)."""
    from kdtree import selfcheck

    key = selfcheck.current_key("cuda")
    path = selfcheck.verdict_path(key, tmp / "cache")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": selfcheck.FORMAT, "key": dataclasses.asdict(key), "passed": False, "rows": []}))
    return str(tmp / "cache")


def _full_disk(tmp: Path, request) -> str:
    """A 2 MB tmpfs: the first capture file (~3 MB) finds the disk full. Skips where this machine cannot mount."""
    where = tmp / "full"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    request.addfinalizer(lambda: subprocess.run(["umount", str(where)], check=False))
    return str(where)


@pytest.mark.parametrize(
    "fault", ["kernel-does-not-build", "no-cupy", "capture-dir-unwritable", "corrupt-verdict-cache", "full-capture-disk"]
)
def test_a_fault_is_logged_once_and_every_request_is_answered(model, out, fault, tmp_path, request):
    """A live server with kdtree broken underneath: the kernel cannot be built (KDTREE_KERNEL_TARGET names no
    target), CuPy is not importable, the capture folder cannot be made, the self-check's cached verdict is
    malformed, the capture disk is full. The server starts and answers every request; one line says why (where the
    verdict was malformed, the check runs again and kdtree serves)."""
    mode, env, mark = {
        "kernel-does-not-build": ("serve", lambda: {"KDTREE_KERNEL_TARGET": "sm_999"}, "could not prepare"),
        "no-cupy": ("serve", lambda: {"PYTHONPATH": _cupy_blocked(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}, "could not prepare"),
        "capture-dir-unwritable": ("capture", lambda: {"KDTREE_CAPTURE_DIR": str(Path(__file__)) + "/captures"}, "capture stopped"),
        "corrupt-verdict-cache": ("serve", lambda: {"KDTREE_CACHE_DIR": _corrupt_verdict_cache(tmp_path), "KDTREE_SELFCHECK": "1"}, "cached verdict ignored"),
        "full-capture-disk": ("capture", lambda: {"KDTREE_CAPTURE_DIR": _full_disk(tmp_path, request)}, "capture stopped"),
    }[fault]  # fmt: skip
    env = env()
    s = replace(BASE, requests=12, concurrency=4, max_new_tokens=32)
    r = check.run_mode(mode, model, SPEC, s, out, name=f"fault-{fault}", env=env)
    assert r.answered == r.requests == 12
    lines = fallback_lines(r.log, mark)
    assert len(lines) >= 1 and len(set(lines)) == len(lines), lines  # said, and each reason once
    assert not r.stopped["group_left"]


@pytest.fixture(scope="module", autouse=True)
def keep_two_captures(out):
    """After the capture tests: a tree that branches deeper than the first step of each tree test, and a whole
    chain, copied to out/ship/ (for data/)."""
    yield
    ship = out / "ship"
    for name, keep in (
        ("capture-n16", lambda c: c["branches_below_root"]),
        ("capture-n64", lambda c: c["branches_below_root"]),
        ("capture-chain-page16", lambda c: c["max_branching"] == 1),
    ):
        report = out / f"{name}.json"
        if report.exists():
            ship.mkdir(exist_ok=True)
            for c in [c for c in json.loads(report.read_text())["captures"] if keep(c)][:1]:
                shutil.copy(c["path"], ship / f"{name}-{Path(c['path']).name}")
