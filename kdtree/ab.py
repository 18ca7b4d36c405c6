"""A/B: the kernel as edited in the working tree against the kernel of a commit (HEAD by default), built side by
side as two modules from two source trees - resources per target without a GPU, error against the oracle and time
on one. What notebook 05 shows after an edit."""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

from kdtree.kernel.config import KERNEL_DIR, SOURCE

_trees: dict[str, Path] = {}


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
