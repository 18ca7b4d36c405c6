"""A/B: the kernel as edited in the working tree against the kernel of a commit (HEAD by default), built side by
side as two modules from two source trees - resources per target without a GPU, error against the oracle and time
on one. What notebook 05 shows after an edit."""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

from kdtree.kernel.config import ARCH_LIMITS, KERNEL_DIR, SOURCE

_trees: dict[str, Path] = {}
# the targets an edit is compiled for when nothing can run it: every one kdtree has limits for (sm_90a is sm_90's
# Hopper bodies, which sm_90's candidates include)
EVERY_TARGET = [a for a in ARCH_LIMITS if a != "sm_90a"]


def committed_source(ref: str = "HEAD", repo: Path = KERNEL_DIR.parent) -> Path:
    """verify_mla.cu as `ref` has it (its whole kernels/ tree, from `git archive`, in a temporary folder kept for
    this process); ValueError naming the ref when git cannot give it."""
    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise ValueError(f"{ref}: not a commit of {repo} ({r.stderr.strip() or 'git failed'})")
    commit = r.stdout.strip()
    if commit not in _trees:
        tar = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", commit, KERNEL_DIR.name], capture_output=True, check=True
        )
        root = Path(tempfile.mkdtemp(prefix=f"kdtree-{commit[:12]}-"))
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(root, filter="data")
        _trees[commit] = root
    return _trees[commit] / KERNEL_DIR.name / SOURCE.name


def compile_ab(archs: list[str], a: Path, b: Path = SOURCE, *, every_config: bool = False) -> list[dict]:
    """Per target and kernel: registers, spills and shared memory of `a` (e.g. the commit's) and `b` (the edit),
    with the configuration each target runs first (`every_config`: all it may run)."""
    from kdtree.kernel import KernelConfig, compile_report

    rows = []
    for arch in archs:
        for config in KernelConfig.candidates(arch) if every_config else [KernelConfig.for_arch(arch)]:
            ra, rb = compile_report(arch, config, source=a), compile_report(arch, config, source=b)
            for x, y in zip(ra, rb):
                rows.append(
                    {
                        "arch": x.arch,
                        "kernel": x.name,
                        "bm": x.bm,
                        "registers": (x.registers, y.registers),
                        "spills": (x.spill_stores + x.spill_loads, y.spill_stores + y.spill_loads),
                        "smem": (x.static_smem + x.dynamic_smem, y.static_smem + y.dynamic_smem),
                        "ok": (x.ok, y.ok),
                    }
                )
    return rows


def format_compile_ab(rows: list[dict], names: tuple[str, str] = ("HEAD", "edited")) -> str:
    a, b = names
    head = f"{'target':8s} {'kernel':18s} {'BM':>3s}  {'registers ' + a + ' -> ' + b:>26s}  {'spill B':>12s}  {'smem B':>20s}  ok"
    lines = [head]
    for r in rows:
        (ra, rb), (sa, sb), (ma, mb), (oa, ob) = r["registers"], r["spills"], r["smem"], r["ok"]
        mark = "" if (ra, sa, ma) == (rb, sb, mb) else "  <- changed"
        lines.append(
            f"{r['arch']:8s} {r['kernel']:18s} {r['bm']:3d}  {ra:>12d} -> {rb:<11d}  {sa:>5d} -> {sb:<4d}  {ma:>8,d} -> {mb:<8,d}  "
            f"{'yes' if oa else 'NO'} -> {'yes' if ob else 'NO'}{mark}"
        )
    return "\n".join(lines)


def run_ab(captures, a: Path, b: Path = SOURCE, *, timed: bool = True) -> list[dict]:
    """On a GPU: each capture's layers through kernel `a` and kernel `b` (each its own module): rel against the
    fp64 oracle and, `timed`, the median launch time of each (`kdtree.bench.median_ms`)."""
    import torch

    from kdtree.diff import compare
    from kdtree.kernel import VerifyKernel
    from kdtree.marshal import marshal
    from kdtree.outputs import AttnOutput, poisoned
    from kdtree.reference import oracle

    rows = []
    for cap in captures:
        args = marshal(cap)
        T, H = cap.num_tokens, cap.meta.num_heads
        for lid in cap.meta.layer_ids:
            q, pool = cap.layer(lid).q.to("cuda"), cap.pool(lid, "cuda")
            ref = oracle(cap, lid, device="cuda")
            row = {"capture": cap.where, "layer": lid}
            for name, source in (("a", a), ("b", b)):
                kern = VerifyKernel.get(source=source)
                o = poisoned((T, H, cap.meta.v_head_dim), "cuda")
                lse = torch.full((T, H), float("nan"), device="cuda")
                kern.run(args, q, pool, o, lse)
                row[f"rel_{name}"] = compare(cap, lid, AttnOutput(o, lse), ref).rel
                if timed:
                    from kdtree.bench import median_ms

                    row[f"ms_{name}"] = median_ms(lambda kern=kern, o=o, lse=lse: kern.run(args, q, pool, o, lse))
            rows.append(row)
    return rows


def ptx_changes(archs: list[str], a: Path, b: Path = SOURCE) -> list[str]:
    """The configurations ("sm_90 blocks64") every target of `archs` may run whose PTX differs between kernel `a`
    (say HEAD's) and `b` (the edit): empty when the edit leaves the compiled kernel as it was. No GPU needed:
    what a CPU machine can honestly say of an edit it cannot run."""
    from kdtree.kernel import KernelConfig, nvrtc_ptx

    return [
        f"{arch} {config.body}"
        for arch in archs
        for config in KernelConfig.candidates(arch)
        if nvrtc_ptx(arch, config, source=a) != nvrtc_ptx(arch, config, source=b)
    ]


def model_verdict(model_passed: bool, changes: list[str] | None, ref: str = "HEAD") -> tuple[str, str]:
    """(word, sentence): what a diff of the kernel's torch model says of the kernel on a machine where the CUDA
    kernel cannot run. The model shares the kernel's arguments, split and merge, not its .cu: its PASS speaks for
    the .cu only where the .cu compiles to `ref`'s PTX (`changes` empty; None: not compared). An edit that changes
    the PTX is NOT RUN here, never PASS."""
    if not model_passed:
        return "FAIL", "the kernel's torch model fails the oracle: the marshaling or plan it shares with the kernel is wrong"
    if changes is None:
        return (
            "MODEL PASS",
            "the kernel's torch model passes; the CUDA kernel did not run here (no GPU), and its PTX was not compared",
        )
    if not changes:
        return "PASS", (
            f"the kernel's torch model passes; the .cu here compiles as {ref}'s (unedited, or its PTX unchanged for every "
            "target kdtree knows), and the CUDA kernel did not run here"
        )
    return "NOT RUN", (
        f"the edit changes the compiled kernel ({', '.join(changes)}) and no GPU is here to run it: the torch model's "
        "pass says nothing of the edit; diff it on a GPU (kdtree diff --impl cuda)"
    )


def edits_against(ref: str = "HEAD", source: Path = SOURCE) -> list[str] | None:
    """The configurations whose PTX the working tree's edit of the kernel (`source`, in a checkout's kernels/)
    changes against `ref`, over every target kdtree knows (ptx_changes); [] for no edit; None where nothing can be
    compared (kernels/ not tracked by git, as in an installed kdtree; no NVRTC). KernelCompileError where the edit
    does not compile."""
    from kdtree.kernel import KernelCompileError

    repo, folder = source.parent.parent, source.parent.name
    try:
        tracked = subprocess.run(["git", "-C", str(repo), "ls-files", "--error-unmatch", folder], capture_output=True, timeout=60)
        if tracked.returncode != 0:  # no checkout, or one that does not track this kernels/ (a venv inside it)
            return None
        r = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", ref, "--", folder], capture_output=True, timeout=60)
        if r.returncode not in (0, 1):
            return None
        return [] if r.returncode == 0 else ptx_changes(EVERY_TARGET, committed_source(ref, repo), source)
    except KernelCompileError:
        raise
    except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError):  # RuntimeError: no NVRTC here
        return None


def diff_verdict(passed: bool, impl: str) -> tuple[str, str | None]:
    """(word, note) closing a diff of `impl` against a reference: PASS or FAIL for an implementation that ran;
    for the kernel's torch model, `model_verdict` against the working tree's kernel (what `kdtree diff` and the
    kernel notebook print). Only PASS is a pass."""
    from kdtree.kernel import KernelCompileError

    if impl != "model" or not passed:
        return ("PASS" if passed else "FAIL"), None
    try:
        return model_verdict(passed, edits_against())
    except KernelCompileError as e:
        return "FAIL", f"the edited kernel does not compile: {str(e).splitlines()[0]}"
