"""`kdtree` command line: info, synth, diff, compile, plan, bench, server-check, selfcheck, tune, report.

Exit codes: 0 success / within tolerance; 1 outside tolerance or a failed check; 2 bad input (`BadInput`, raised
where the input is checked: one line on stderr naming what and where, no traceback, nothing written); 3 a bug in
kdtree (any other exception: its traceback, then a line asking to report it).
"""

from __future__ import annotations

import errno
import json
import os
import select
import sys
import traceback
from functools import wraps
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress

from kdtree.capture import load, save
from kdtree.errors import BadInput, printable
from kdtree.files import UnreadableFile, parse_json, read_small_text

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Workbench for tree-verify MLA attention kernels: captures, references, diffs.",
)


BAD_INPUT_EXIT = 2
BUG_EXIT = 3
BUG_HINT = "kdtree: this is a bug; please report it with the traceback above"
PIPE_CLOSED_EXIT = 141  # the reader of stdout went away (`| head`): what a shell reports for a process SIGPIPE ended
# how typer ends a command on purpose (an exit code, a usage error, an abort): not errors of kdtree's. Typer
# (0.29 on) is built on no click: kdtree imports none, so an install without click works.
_CLI_EXITS = (typer.Exit, typer.Abort, typer.TyperException)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe its reader has closed (`| head` after its lines): poll reports an error there. If
    so, stdout is pointed at /dev/null, so that what is still buffered goes nowhere and no later flush fails."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


def _flush_stdout() -> bool:
    """Flush stdout; False where its reader has gone. A broken pipe anywhere else is not this one: it propagates."""
    try:
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return False


# what a machine answers when it will not read or write a file: bad input (exit 2), not kdtree's bug
REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.EIO,
            errno.ENOTDIR, errno.EISDIR, errno.EBUSY}  # fmt: skip


def _bug_or_pipe(e: BaseException):
    """Raised inside `except`: stdout closed by its reader -> exit 141, quietly; anything else is a bug -> its
    traceback, a line asking to report it, exit 3."""
    if isinstance(e, BrokenPipeError) and _stdout_gone():  # a write found stdout closed by its reader
        raise typer.Exit(PIPE_CLOSED_EXIT) from None
    traceback.print_exc()
    typer.echo(BUG_HINT, err=True)
    raise typer.Exit(BUG_EXIT) from None


def exit_codes(fn):
    """Bad input (BadInput) -> one line on stderr and exit 2, and so is an OSError naming a file (a full disk, a
    read-only folder, a file too big: the machine's refusal, not kdtree's bug); any other exception is a bug -> its
    traceback, a line asking to report it, exit 3. An IndexError or KeyError is a bug too: bad input is checked and raised as
    BadInput where it is read, never inferred from an exception's type. Stdout closed by its reader (`| head`) is
    neither: exit 141, quietly, unless a bad input or a bug was already on its way out."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except _CLI_EXITS:
            if not _flush_stdout():
                raise typer.Exit(PIPE_CLOSED_EXIT) from None
            raise
        except BadInput as e:
            _flush_stdout()
            typer.echo(f"kdtree: error: {printable(e)}", err=True)
            raise typer.Exit(BAD_INPUT_EXIT) from None
        except OSError as e:
            if e.filename is None or e.errno not in REFUSALS:  # no file named, or not the machine's no: a bug
                return _bug_or_pipe(e)
            _flush_stdout()  # a file the machine would not let kdtree read or write (full disk, read-only, too big)
            typer.echo(f"kdtree: error: {printable(e.filename)}: {printable(e.strerror or e)}", err=True)
            raise typer.Exit(BAD_INPUT_EXIT) from None
        except Exception as e:
            _bug_or_pipe(e)
        if not _flush_stdout():
            raise typer.Exit(PIPE_CLOSED_EXIT)
        return result

    return wrapper


def command(name: str | None = None):
    """`app.command`, with `exit_codes` around the command: every command maps its errors the same way."""

    def register(fn):
        return app.command(name)(exit_codes(fn))

    return register


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise BadInput(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise BadInput(f"{what}: expected at least one integer")
    return values


def _importable(module: str) -> bool:
    """Whether `module` can be imported, without importing it (its parent packages are)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _capture_paths(paths: List[Path]) -> list[Path]:
    """Files as given; a directory stands for the capture files (*.safetensors) in it."""
    from kdtree.capture import capture_files

    return [f for p in paths for f in capture_files(p)]


def _progress(total: int, label: str) -> Progress:
    """A progress bar on stderr, only when it is a terminal; plain prints go above it."""
    p = Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty() or total < 2)
    p.add_task(label, total=total)
    return p


@command()
def info(
    captures: List[Path] = typer.Argument(..., help="capture files (.safetensors), or directories of them"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
):
    """Validate captures and summarise them: batch, prefix lengths, N, heads, tree shape, pool fragmentation."""
    from kdtree.info import format_summary, summarize

    summaries = [summarize(load(p)) for p in _capture_paths(captures)]
    if as_json:
        typer.echo(json.dumps(summaries, indent=1))
    else:
        typer.echo("\n".join(format_summary(s) for s in summaries))


@command()
def synth(
    output: Path = typer.Option(..., "--output", "-o", help="where to write the capture"),
    preset: str = typer.Option("kimi-k2-tp8", help="kimi-k2-tp8 (H=8), deepseek-v3-tp8 (H=16), kimi-k2-dp (H=64)"),
    batch: int = typer.Option(1, "--batch", "-b", help="batch size"),
    prefix: str = typer.Option("1024", help="prefix lengths: one for all requests, or comma-separated, one per request"),
    tree: str = typer.Option("ddtree", help="ddtree, eagle, chain (DFlash without a tree), star, random"),
    budget: Optional[int] = typer.Option(None, help="DDTree node budget (N = budget + 1); default 64"),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", "-n", help="N for the other tree kinds"),
    topk: Optional[int] = typer.Option(None, help="drafter top-k per position (ddtree 8, eagle 4)"),
    max_depth: Optional[int] = typer.Option(None, help="ddtree: block size - 1 (15); eagle: steps (5)"),
    layers: str = typer.Option("0", help="layer ids, comma-separated"),
    seed: int = typer.Option(0, help="random seed (same seed, same bytes)"),
    pool_size: Optional[int] = typer.Option(None, help="pool slots (default: 1.5x the referenced ones)"),
    extreme_logits: bool = typer.Option(False, help="scale logits x8: rows dominated by one key"),
    logit_cap: float = typer.Option(0.0, help="tanh soft cap (0 = off, as for Kimi/DeepSeek)"),
    reference: str = typer.Option("oracle", help="what computes o: oracle (fp64), sglang (its Triton kernel; GPU), none"),
    force: bool = typer.Option(False, help="overwrite an existing file"),
):
    """Write a synthetic capture in the capture format, with `o` from the fp64 oracle."""
    from kdtree.synth import SynthSpec, synthesize

    if output.exists() and not force:
        raise BadInput(f"{output} exists; pass --force to overwrite it")
    if (output.exists() or output.is_symlink()) and not output.is_file():
        raise BadInput(f"{output} is not a regular file: kdtree replaces only a capture file, even with --force")
    spec = SynthSpec(
        preset=preset,
        batch_size=batch,
        prefix_lens=_int_list(prefix, "--prefix"),
        tree=tree,
        budget=budget,
        num_draft_tokens=num_draft_tokens,
        topk=topk,
        max_depth=max_depth,
        layers=_int_list(layers, "--layers"),
        seed=seed,
        pool_size=pool_size,
        extreme_logits=extreme_logits,
        logit_cap=logit_cap,
    )
    cap = synthesize(spec, device="cuda" if reference == "sglang" else "cpu", reference=reference)
    save(cap, output)
    typer.echo(f"wrote {output} ({output.stat().st_size / 2**20:.1f} MiB): {load(output)!r}")  # read back: it validates


@command()
def diff(
    captures: List[Path] = typer.Argument(..., help="capture files (.safetensors), or directories of them"),
    impl: Optional[str] = typer.Option(
        None,
        help="implementation under test: cuda (the kernel, default on a GPU), model (default without one), emulation, "
        "oracle, sglang (SGLang's Triton kernel, on a GPU), capture",
    ),
    ref: str = typer.Option("oracle", help="reference: oracle (fp64), capture (the o SGLang produced), emulation"),
    inject: Optional[str] = typer.Option(None, help="marshaling fault to inject: prefix-only-kv, prefix-stride"),
    layer: Optional[List[int]] = typer.Option(None, help="only these layers (repeatable)"),
    tol: float = typer.Option(1e-2, help="pass when rel <= tol (and nothing is NaN or unwritten)"),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when present)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
):
    """Run an implementation on captures and diff it against a reference, per layer.

    Prints `\\[kdtree] L<layer> max_abs_diff=... mean=... rel=...` per layer; exit 0 when every layer
    passes, 1 when any is outside tolerance, 2 on bad input, 3 on a bug.
    """
    from kdtree.impls import IMPLS, default_impl, diff_capture, unavailable
    from kdtree.marshal import FAULTS

    impl = impl or default_impl()
    for name, what in ((impl, "--impl"), (ref, "--ref")):
        if name not in IMPLS:
            raise BadInput(f"{what}: unknown implementation {name!r}; expected one of {', '.join(IMPLS)}")
    for name in {impl, ref}:
        why = unavailable(name)
        if why:
            raise BadInput(why)
    if inject is not None and inject not in FAULTS:
        raise BadInput(f"--inject: unknown fault {inject!r}; expected one of {', '.join(FAULTS)}")
    if inject is not None and not IMPLS[impl][1]:
        marshaled = ", ".join(k for k, v in IMPLS.items() if v[1])
        raise BadInput(f"--inject needs an --impl that reads the marshaled arguments ({marshaled}), not {impl!r}")
    if device is not None:
        import torch

        if device != "cpu" and not device.startswith("cuda"):
            raise BadInput(f"--device: cpu or cuda, got {device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BadInput(f"--device {device}: this machine has no CUDA GPU")
        if device == "cpu" and "cuda" in (impl, ref):
            raise BadInput("--impl cuda runs the kernel on a GPU, not with --device cpu")
    if not 0 < tol < float("inf"):
        raise BadInput(f"--tol must be a finite number > 0, got {tol}")
    paths, total = _capture_paths(captures), 0
    for p in paths:  # validate every capture before running anything; then one capture in memory at a time
        ids = load(p).meta.layer_ids
        for lid in layer or []:
            if lid not in ids:
                raise BadInput(f"{p}: --layer {lid} not in the capture's layers {ids}")
        total += len(layer or ids)
    report, all_passed = [], True
    with _progress(total, f"diff {impl} vs {ref}") as progress:
        task = progress.task_ids[0]
        for p in paths:
            cap = load(p)
            if not as_json:
                typer.echo(f"{printable(cap.where)}  impl={impl} ref={ref}" + (f" inject={inject}" if inject else ""))

            def show(d):
                progress.advance(task)
                if not as_json:
                    typer.echo(d.line())
                    if not d.passed:
                        w = d.worst
                        typer.echo(
                            f"  worst: request {w['request']} node {w['node']} (depth {w['depth']}) head {w['head']} "
                            f"abs {w['abs_diff']:.4e} rel {w['rel']:.4e}"
                        )

            results = diff_capture(
                cap, impl, ref, fault=inject, layers=layer or None, tolerance=tol, device=device, on_layer=show
            )
            passed = all(d.passed for d in results)
            all_passed &= passed
            report.append(
                {
                    "path": cap.where,
                    "impl": impl,
                    "ref": ref,
                    "inject": inject,
                    "passed": passed,
                    "layers": [d.to_json() for d in results],
                }
            )
    from kdtree.ab import diff_verdict

    # the model with a fault injected checks the harness, not the kernel: its verdict is its own
    verdict, note = diff_verdict(all_passed, impl if inject is None else "injected")
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "passed": verdict in ("PASS", "MODEL PASS"),
                    "verdict": verdict,
                    "note": note,
                    "tolerance": tol,
                    "captures": report,
                },
                indent=1,
            )
        )
    else:
        n_layers = sum(len(r["layers"]) for r in report)
        if note:  # before the verdict, which stays the last line
            typer.echo(f"note: {note}")
        typer.echo(f"{verdict}: {n_layers} layer(s) of {len(report)} capture(s), tolerance rel <= {tol:g}")
    raise typer.Exit(0 if verdict in ("PASS", "MODEL PASS") else 1)  # NOT RUN: an edit nobody verified is no pass


@command("compile")
def compile_(
    arch: List[str] = typer.Option(["sm_120", "sm_90"], "--arch", help="targets (repeatable): sm_120, sm_90, sm_89, ..."),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    nvrtc_lib: Optional[Path] = typer.Option(None, "--nvrtc", help="libnvrtc.so.N to compile with instead of the installed one"),
):
    """Cross-compile kernels/verify_mla.cu with NVRTC (no GPU needed) and report registers, spills and
    shared memory per kernel against each target's limits. Exit 1 on spills or over-limit shared memory."""
    from kdtree.kernel import (
        ARCH_LIMITS,
        KernelCompileError,
        KernelConfig,
        compile_report,
        nvrtc_version,
        source_files,
        use_nvrtc_library,
    )

    for a in arch:
        if a not in ARCH_LIMITS:
            raise BadInput(f"--arch: unknown target {a!r}; expected one of {', '.join(ARCH_LIMITS)}")
    if nvrtc_lib is not None:
        try:
            use_nvrtc_library(nvrtc_lib)
        except ValueError as e:
            raise BadInput(str(e)) from None
        except OSError as e:  # not a library the loader takes
            raise BadInput(f"--nvrtc: cannot load {nvrtc_lib}: {e}") from None
    if not _importable("cuda.bindings.nvrtc"):
        raise BadInput("kdtree compile needs NVRTC: pip install -e '.[nvrtc]' (cuda-bindings, nvidia-cuda-nvrtc)")
    try:
        # every configuration the target may run (sm_90: BM 64, and BM 32 for small batches)
        reports = [r for a in arch for c in KernelConfig.candidates(a) for r in compile_report(a, c)]
    except KernelCompileError as e:  # the kernel source does not build: NVRTC's log, as it names the lines
        typer.echo(str(e), err=True)
        raise typer.Exit(BAD_INPUT_EXIT) from None
    if as_json:
        import dataclasses

        typer.echo(json.dumps([dataclasses.asdict(r) | {"ok": r.ok} for r in reports], indent=1))
    else:
        typer.echo("sources: " + ", ".join(p.name for p in source_files()) + f"   (NVRTC {nvrtc_version()})")
        for r in reports:
            typer.echo(r.line())
    raise typer.Exit(0 if all(r.ok for r in reports) else 1)


@command("plan")
def plan_(
    captures: Optional[List[Path]] = typer.Argument(None, help="capture files (.safetensors), or directories of them"),
    case: Optional[List[str]] = typer.Option(None, help="bench cases whose name contains this (repeatable)"),
    target: str = typer.Option("sm_90", help="plan with this target's candidates: sm_90 (Hopper), sm_120, ..."),
    sms: Optional[int] = typer.Option(
        None, help="SMs of the GPU planned for (default: the target's, RTX PRO 6000 188 for sm_120, else H200 132)"
    ),
    l2_mib: Optional[float] = typer.Option(
        None, "--l2-mib", help="its L2 cache in MiB (default: RTX PRO 6000 ~122 for sm_120, else H200 60; 0: unknown)"
    ),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
):
    """Show every plan the cost model weighs for a batch on a target, and its pick: body, key range, split,
    grid, partial slots, the largest and mean block (padded units), the most segments a block holds, cost. No GPU
    needed."""
    import math

    from kdtree.kernel.config import TARGET_NAMES, KernelConfig
    from kdtree.marshal import marshal
    from kdtree.plan_report import format_report, plan_report, target_gpu

    if target not in TARGET_NAMES:
        raise BadInput(f"--target: unknown target {target!r}; expected one of {' '.join(TARGET_NAMES)}")
    gpu, default_sms, default_l2 = target_gpu(target)
    title = f"{target} (as an {gpu})" if sms is None and l2_mib is None else target  # say which part was assumed
    sms, l2_mib = default_sms if sms is None else sms, default_l2 if l2_mib is None else l2_mib
    if sms < 1 or not math.isfinite(l2_mib) or l2_mib < 0:
        raise BadInput(f"--sms must be at least 1 and --l2-mib finite and not negative (got {sms}, {l2_mib})")
    if not captures and not case:
        raise BadInput("give capture files, or --case with a bench case's name")
    batches = [(str(p), load(p)) for p in _capture_paths(captures or [])]
    if case:
        from kdtree import bench as b
        from kdtree.synth import synthesize

        picked = b.select_cases(case)
        if not picked:
            raise BadInput(f"--case matches none of: {', '.join(c.name for c in b.BENCH_CASES)}")
        batches += [(c.name, synthesize(c.spec(), reference=False)) for c in picked]
    configs = KernelConfig.candidates(target)
    l2_bytes = int(l2_mib * 2**20)
    reports = [
        {"batch": name, "target": target} | plan_report(marshal(cap), cap.meta.num_heads, sms, configs, l2_bytes=l2_bytes)
        for name, cap in batches
    ]
    if as_json:
        typer.echo(json.dumps(reports, indent=1))
    else:
        typer.echo("\n\n".join(format_report(f"{printable(r['batch'])}: {title}", r) for r in reports))


@command()
def bench(
    out: Path = typer.Option(Path("bench-out"), "--out", "-o", help="folder for bench.json and bench.png"),
    case: Optional[List[str]] = typer.Option(
        None, help="only cases whose name contains this (repeatable; with --chain, the DDTree cases' names)"
    ),
    no_sglang: bool = typer.Option(False, "--no-sglang", help="skip SGLang's Triton kernel even if importable"),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        help="run the configuration another target would run (e.g. sm_120), where it fits; sm_90a-blocks64: the "
        "blocks64 body alone (Hopper)",
    ),
    chain: bool = typer.Option(
        False,
        "--chain",
        help="the cases with chain drafts (EAGLE topk 1), with FlashInfer's causal MLA kernel timed beside kdtree "
        "where FlashInfer imports",
    ),
    flashinfer_backend: Optional[str] = typer.Option(
        None,
        "--flashinfer-backend",
        help="with --chain: FlashInfer's MLA backend to time (fa3: its Hopper kernel; fa2: its portable mma.sync one, "
        "what an sm_120 part runs); default: fa3 where it runs, else fa2",
    ),
    sglang_backend: bool = typer.Option(
        False,
        "--sglang",
        help="the kdtree backend against SGLang's Triton backend "
        "(eager and CUDA-graph replayed, metadata and host time); needs SGLang",
    ),
    server: bool = typer.Option(
        False,
        "--server",
        help="real SGLang servers on a tiny checkpoint, kdtree serving against Triton under CUDA graphs: output "
        "tokens/s and the verify step's time (needs SGLang)",
    ),
    prompt_len: Optional[List[int]] = typer.Option(None, "--prompt-len", help="--server: prompt lengths (repeatable)"),
    batch: Optional[List[int]] = typer.Option(None, "--batch", help="--server: concurrent requests (repeatable)"),
    draft_tokens: Optional[List[int]] = typer.Option(None, "--draft-tokens", help="--server: NGRAM draft tokens (repeatable)"),
    heads: Optional[List[int]] = typer.Option(None, "--heads", help="--server: heads per rank of the model (repeatable)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="--server: tensor-parallel size (--tp-size; one GPU a rank)"),
    from_json: Optional[List[Path]] = typer.Option(
        None,
        "--from",
        help="--server: no servers; the bench-server.json of earlier runs (repeatable) merged, tabled, projected "
        "and plotted into -o",
    ),
):
    """Time the kernel against SGLang's Triton kernel and plain torch on the anchor cases, with the
    roofline from ceilings measured in the same run. Needs a CUDA GPU."""
    from kdtree import bench as b
    from kdtree.impls import gpu_available

    if chain and sglang_backend:
        raise BadInput("--chain and --sglang do not combine: --sglang times the backend on DDTree steps")
    grid = {"prompt_lens": prompt_len, "batches": batch, "draft_tokens": draft_tokens, "heads": heads}
    if tp is not None and (not server or from_json):
        raise BadInput("--tp goes with --server (and not with --from)")
    if from_json and not server:
        raise BadInput("--from goes with --server")
    if server and from_json:
        if any(grid.values()):
            raise BadInput("--from re-reads runs: --prompt-len, --batch, --draft-tokens and --heads do not apply")
        _bench_server_outputs(_merged_server_runs(from_json), out)
        return
    if server:
        _bench_server(out, {k: tuple(v) for k, v in grid.items() if v} | ({"tp": tp} if tp is not None else {}))
        return
    if any(grid.values()):
        raise BadInput("--prompt-len, --batch, --draft-tokens and --heads go with --server")
    from kdtree.flashinfer_mla import BACKENDS

    if flashinfer_backend is not None and (not chain or flashinfer_backend not in BACKENDS):
        raise BadInput(f"--flashinfer-backend: one of {' '.join(BACKENDS)}, with --chain (got {flashinfer_backend!r})")
    from kdtree.kernel.config import TARGET_NAMES

    if target is not None:
        if target not in TARGET_NAMES:
            raise BadInput(f"--target: unknown target {target!r}; expected one of {' '.join(TARGET_NAMES)}")
        os.environ["KDTREE_KERNEL_TARGET"] = target  # read when the kernel is built (kdtree.kernel.target_arch)
    elif os.environ.get("KDTREE_KERNEL_TARGET", "") not in ("", *TARGET_NAMES):
        named = os.environ["KDTREE_KERNEL_TARGET"]
        raise BadInput(f"KDTREE_KERNEL_TARGET={named!r}: expected one of {' '.join(TARGET_NAMES)}")
    if not gpu_available():
        raise BadInput("kdtree bench needs a CUDA GPU and CuPy (pip install -e '.[cuda13]')")
    if sglang_backend:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise BadInput("kdtree bench --sglang needs SGLang (pip install -e '.[sglang]')")
        from kdtree.sglang import bench as sb

        picked = [c for c in sb.SERVING_CASES if not case or any(p in c.name for p in case)]
        if not picked:
            raise BadInput(f"--case matches none of: {', '.join(c.name for c in sb.SERVING_CASES)}")
        result = sb.run(picked, log=typer.echo)
        sb.save(result, out / "bench-sglang.json")
        typer.echo(f"wrote {out / 'bench-sglang.json'}")
        return
    cases = b.select_cases(case) if case else list(b.BENCH_CASES)
    if not cases:
        raise BadInput(f"--case matches none of: {', '.join(c.name for c in b.BENCH_CASES)}")
    if chain:
        cases = [c.as_chain() for c in cases]
    backends = (flashinfer_backend,) if flashinfer_backend else None
    result = b.run(cases, with_sglang=not no_sglang, with_flashinfer=chain, flashinfer_backends=backends, log=typer.echo)
    js, png = b.save(result, out)
    typer.echo(b.summary_table(result))
    typer.echo(f"wrote {js} and {png}")


def _interrupt_code(e: KeyboardInterrupt) -> int:
    """The shell's code for what stopped us: 143 for SIGTERM, 130 for Ctrl-C."""
    from kdtree.server.process import Terminated

    return 143 if isinstance(e, Terminated) else 130


def _server_prerequisites(command: str, tp: int) -> None:
    """What a real SGLang server over the tiny checkpoint needs (`server-check`, `bench --server`), all that is
    missing named in one message, the GPU first; and a GPU a rank."""
    import importlib.util

    import torch

    missing = [] if torch.cuda.is_available() else ["a CUDA GPU (it launches a real SGLang server)"]
    for module, what in (
        ("sglang", "SGLang (pip install -e '.[sglang]')"),
        ("transformers", "transformers"),
        ("tokenizers", "tokenizers"),
    ):
        if importlib.util.find_spec(module) is None:
            missing.append(what)
    if missing:
        raise BadInput(f"{command} needs {', '.join(missing)}: missing here")
    if tp > torch.cuda.device_count():
        raise BadInput(f"--tp {tp}: this machine has {torch.cuda.device_count()} GPU(s)")


def _bench_server(out: Path, grid: dict) -> None:
    """`kdtree bench --server`: checked before any server starts; the table printed, JSON and PNG in `out`."""
    from kdtree.server import bench as sb

    settings = sb.ServerBenchSettings(**grid)
    settings.check()
    _server_prerequisites("kdtree bench --server", settings.tp)
    from kdtree.server.process import sigterm_as_interrupt

    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a directory")
    console = Console(stderr=True)
    try:
        with sigterm_as_interrupt(), console.status("bench --server") as status:
            result = sb.run(settings, out, say=status.update)
    except KeyboardInterrupt as e:
        typer.echo(
            f"kdtree bench --server: interrupted; servers stopped; partial result in {out / 'bench-server.json'}", err=True
        )
        raise typer.Exit(_interrupt_code(e)) from None
    _bench_server_outputs(result, out, written=True)


def _merged_server_runs(paths: list[Path]):
    """`--from`: the files read (each named where it is missing or not JSON) and merged."""
    from kdtree.server import bench as sb

    runs = []
    for path in paths:
        try:
            text = read_small_text(path, limit=64 << 20)
            data = None if text is None else parse_json(text)
        except (UnreadableFile, ValueError) as e:
            raise BadInput(f"--from {path}: not readable JSON ({e})") from None
        if text is None:
            raise BadInput(f"--from {path}: no such file")
        runs.append((str(path), data))
    return sb.merge(runs)


def _bench_server_outputs(result: dict, out: Path, *, written: bool = False) -> None:
    """The table and the projections printed; the JSON (unless the run wrote it) and the figure in `out`."""
    from kdtree.plots import server_bench_figure
    from kdtree.server import bench as sb
    from kdtree.server.check import write_json
    from kdtree.server.projection import format_projections

    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a directory")
    if not written:
        write_json(out / "bench-server.json", result)
    typer.echo(sb.format_table(result["pairs"]))
    if result.get("projections"):
        typer.echo("\nProjected (arithmetic: measured attention a layer x the model's layers + an assumed rest):")
        typer.echo(format_projections(result["projections"]))
    if result["pairs"]:
        gpu = (result.get("environment") or {}).get("gpu") or "GPU not recorded"
        st = result.get("settings", {})
        title = f"{gpu}: tiny DeepSeek-V3-architecture model, {st.get('layers')} layers, TP {st.get('tp', 1)}"
        fig = server_bench_figure(result["pairs"], title=title)
        fig.savefig(out / "bench-server.png", dpi=120, bbox_inches="tight")
    typer.echo(f"wrote {out / 'bench-server.json'}" + (f" and {out / 'bench-server.png'}" if result["pairs"] else ""))
    for problem in result["problems"]:
        typer.echo(f"kdtree bench --server: {problem}", err=True)
    raise typer.Exit(1 if result["problems"] else 0)


@command("server-check")
def server_check(
    out: Path = typer.Option(
        Path("server-check"), "--out", "-o", help="folder for report.json, each mode's server log, captures"
    ),
    mode: Optional[List[str]] = typer.Option(
        None, "--mode", help="shadow, serve, capture (default: all three), triton (a baseline; repeatable)"
    ),
    heads: int = typer.Option(8, help="attention heads per TP rank (Kimi K2.x at TP8: 8; DeepSeek-V3 at TP8: 16)"),
    tp: int = typer.Option(1, help="tensor-parallel size (--tp-size of the server)"),
    layers: int = typer.Option(2, help="layers of the tiny model"),
    hidden_size: int = typer.Option(256, help="hidden size of the tiny model"),
    context_length: int = typer.Option(4096, help="the model's and the server's context length"),
    model_dir: Optional[Path] = typer.Option(
        None, help="where the tiny checkpoint is built (reused if built from the same options)"
    ),
    draft_tokens: int = typer.Option(16, help="NGRAM draft tokens per request (--speculative-num-draft-tokens)"),
    bfs_breadth: int = typer.Option(4, help="NGRAM's BFS breadth (1: chains; above 1: trees where the n-grams branch)"),
    page_size: int = typer.Option(1, help="the KV pool's page size (above 1 needs --bfs-breadth 1)"),
    requests: int = typer.Option(8, help="greedy requests per mode"),
    concurrency: int = typer.Option(4, help="requests in flight at once"),
    max_new_tokens: int = typer.Option(64, help="tokens each request decodes (EOS ignored)"),
    prompt_chars: int = typer.Option(0, help="grow each prompt to at least this many characters"),
    tolerance: float = typer.Option(5e-3, help="shadow mode passes when every rel <= this"),
    entrypoint: str = typer.Option(
        "launch_server", help="launch_server (python -m sglang.launch_server) or serve (sglang serve)"
    ),
    startup_timeout: float = typer.Option(600.0, help="seconds a server may take to answer"),
    server_arg: Optional[List[str]] = typer.Option(None, "--server-arg", help="one more server flag, as given (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
):
    """Launch a real SGLang server with --attention-backend kdtree and NGRAM tree speculation on loopback, over a
    tiny random DeepSeek-V3-architecture checkpoint built offline, in each mode (shadow eager, serve under CUDA
    graphs, capture); drive greedy requests; report per mode. Exit 0 when every mode passes, 1 when one fails,
    2 on bad input or a machine that cannot run it. Run it before pointing kdtree at a real model."""
    from kdtree.server.check import CheckSettings, run_check
    from kdtree.server.checkpoint import TinySpec
    from kdtree.server.process import sigterm_as_interrupt
    from kdtree.server.report import format_report

    spec = TinySpec(heads_per_rank=heads, tp=tp, layers=layers, hidden_size=hidden_size, context_length=context_length)
    settings = CheckSettings(
        modes=tuple(mode) if mode else CheckSettings.modes,
        draft_tokens=draft_tokens,
        bfs_breadth=bfs_breadth,
        page_size=page_size,
        requests=requests,
        concurrency=concurrency,
        max_new_tokens=max_new_tokens,
        prompt_chars=prompt_chars,
        tolerance=tolerance,
        entrypoint=entrypoint,
        startup_timeout=startup_timeout,
        extra_args=tuple(server_arg or ()),
    )
    spec.check()
    settings.check()
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a directory")
    _server_prerequisites("kdtree server-check", tp)
    console = Console(stderr=True)
    try:
        with sigterm_as_interrupt(), console.status("server-check") as status:
            report = run_check(
                spec,
                settings,
                out,
                model_dir=model_dir,
                say=status.update,
                on_mode=lambda r: console.print(f"{r.mode}: {'PASS' if r.passed else 'FAIL'} ({r.seconds:.0f} s)"),
            )
    except KeyboardInterrupt as e:
        typer.echo(f"kdtree server-check: interrupted; servers stopped; partial report in {out / 'report.json'}", err=True)
        raise typer.Exit(_interrupt_code(e)) from None
    typer.echo(json.dumps(report, indent=1, default=str) if as_json else format_report(report))
    typer.echo(f"report: {out / 'report.json'}", err=True)
    raise typer.Exit(0 if report["passed"] else 1)


@command("selfcheck")
def selfcheck_cmd(
    impl: Optional[str] = typer.Option(None, help="cuda (the kernel; default on a GPU) or model (its torch model)"),
    force: bool = typer.Option(False, "--force", help="check again even if this machine's verdict is cached"),
    inject: Optional[str] = typer.Option(None, help="marshaling fault to inject (what a broken kernel looks like)"),
    as_json: bool = typer.Option(False, "--json", help="print the verdict as JSON"),
):
    """The kernel's self-check on this machine: the shipped captures and seeded fuzz batches against the fp64
    oracle, cached per (GPU, compute capability, driver, kernel source) in the user's cache directory (the SGLang
    backend runs it before its first served step). Exit 0 on PASS, 1 on FAIL, 2 on bad options."""
    from kdtree import selfcheck
    from kdtree.impls import default_impl, unavailable
    from kdtree.marshal import FAULTS

    impl = impl or default_impl()
    if impl not in ("cuda", "model"):
        raise BadInput(f"--impl: the self-check runs the kernel (cuda) or its torch model (model), not {impl!r}")
    if why := unavailable(impl):
        raise BadInput(why)
    if inject is not None and inject not in FAULTS:
        raise BadInput(f"--inject: unknown fault {inject!r}; expected one of {', '.join(FAULTS)}")
    if selfcheck.skipped():
        typer.echo(f"{selfcheck.SKIP_VAR}=0 skips the backend's self-check; this command checks all the same", err=True)
    console = Console(stderr=True)
    with console.status("selfcheck") as status:
        outcome = selfcheck.ensure(
            impl,
            force=force or inject is not None,
            fault=inject,
            on_row=lambda r: status.update(f"selfcheck: {r.name} {'PASS' if r.passed else 'FAIL'}"),
            honour_skip=False,
        )
    verdict = outcome.verdict
    for note in outcome.notes:
        typer.echo(f"kdtree: {note}", err=True)
    if as_json:
        typer.echo(json.dumps(verdict.to_json(), indent=1))
    else:
        typer.echo(selfcheck.format_verdict(verdict, outcome.path))
        if outcome.cached:
            typer.echo("(cached verdict; --force checks again)", err=True)
        elif outcome.path is not None:
            typer.echo(f"wrote {outcome.path}", err=True)
    raise typer.Exit(0 if verdict.passed else 1)


@command("tune")
def tune_cmd(
    case: Optional[List[str]] = typer.Option(None, "--case", help="bench cases by substring (default: all twelve)"),
    fuzz: int = typer.Option(40, help="fuzz batches of seeds 0 .. N-1 besides the cases"),
    repeat: int = typer.Option(1, help="time and fit this many times (the picks of each against the last's)"),
    holdout: int = typer.Option(
        0, help="fuzz batches after the fitted ones (seeds N .. N+holdout-1), timed once to check the tuned picks on"
    ),
    out: Path = typer.Option(Path("tune-out"), "--out", "-o", help="folder for tune.json"),
    write: bool = typer.Option(True, "--write/--no-write", help="write the tuning file the planner loads"),
    mma_repeat: int = typer.Option(
        1, help="issue every mma.sync this many times (a part with 1/n the tensor rate; an emulation: never written)"
    ),
):
    """Fit the planner's cost model to this GPU: every plan the planner weighs for the bench cases and fuzz
    batches, timed; a least-squares fit of each body's unit and segment costs; the shipped model's picks and the
    fit's against the fastest plan per batch. Writes the tuning file for this GPU and kernel source (the planner
    loads it; KDTREE_TUNING=off ignores it), and tune.json with every timed plan (units, segments, ms: the fit's
    inputs, to fit again elsewhere). Needs a GPU."""
    from kdtree import tune
    from kdtree.impls import gpu_available
    from kdtree.kernel import source_hash, tuning

    if fuzz < 0 or holdout < 0 or repeat < 1 or mma_repeat < 1:
        raise BadInput(
            f"--fuzz and --holdout must be >= 0, --repeat and --mma-repeat >= 1 (got {fuzz}, {holdout}, {repeat}, {mma_repeat})"
        )
    if not gpu_available():
        raise BadInput("kdtree tune times the kernel: it needs a CUDA GPU with CuPy")
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a directory")
    batches = tune.batches_to_time(list(case or []), fuzz)
    if not batches:
        raise BadInput(f"--case {case}: no bench case matches")
    import torch

    from kdtree.kernel import KernelConfig
    from kdtree.kernel.config import target_arch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    target = target_arch()
    configs = KernelConfig.candidates(target)
    if mma_repeat > 1:
        configs = tuple(c.with_defines([f"VMLA_MMA_REPEAT={mma_repeat}"]) for c in configs)
        write = False
    console = Console(stderr=True)
    with console.status("tune") as status:
        held = tune.batches_to_time(None, holdout, first_seed=fuzz)
        result = tune.tune(batches, configs, repeat=repeat, holdout=held, say=status.update)
    f = result.pop("_model")
    typer.echo(tune.format_summary(result["summary"]))
    for key, what in (("first_pass_under_last_fit", "the first pass's timings"), ("holdout", f"{holdout} held-out batches")):
        if key in result:
            typer.echo(f"\non {what}, under the last pass's fit and picks:")
            typer.echo("\n".join(tune.format_totals(result[key])))
    typer.echo(
        f"measured picks: {len(result['picks'])} shape class(es)" + "".join(f"\n  {k}: {v}" for k, v in result["picks"].items())
    )
    typer.echo(f"fit over {len(batches)} batches: rms {f.rms_rel:.1%} of a launch's time; fitted {', '.join(f.fitted)}")
    for kind in sorted(f.model.unit_cost):
        typer.echo(f"  {kind:12s} unit {f.model.unit_cost[kind]:.3f}  segment {f.model.segment_cost[kind]:.2f}")
    if "repeat_same_picks" in result:
        typer.echo("same tuned picks as the last pass: " + ", ".join(f"{x:.0%}" for x in result["repeat_same_picks"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(result, indent=1, default=str))
    if write:
        path = tuning.tuning_path(props.name, props.multi_processor_count, target)
        sms = props.multi_processor_count
        tuning.save(
            tuning.TuningFile(props.name, sms, source_hash(), f.model, f.fitted, f.rms_rel, target=target, picks=result["picks"]),
            path,
        )
        typer.echo(f"wrote {path} (the planner loads it on this GPU; KDTREE_TUNING=off ignores it)")
    typer.echo(f"wrote {out / 'tune.json'}", err=True)


@command("report")
def report_cmd(
    out: Path = typer.Option(Path("kdtree-report"), "--out", "-o", help="the folder to send back"),
    fuzz: int = typer.Option(40, help="fuzz batches the planner's picks are timed on (with the bench cases)"),
):
    """What to send back from a GPU not in the support matrix (an RTX PRO 6000, say): the environment, the
    self-check, the compile report, the ceilings, the bench against SGLang's Triton kernel (where it imports), and
    the planner's picks before and after a fit to this GPU - report.json, report.png and summary.md in one folder.
    A part that fails is recorded with its error; the others still run. Needs a GPU; about 10 minutes."""
    from functools import partial

    from kdtree import report
    from kdtree.impls import gpu_available

    if not gpu_available():
        raise BadInput("kdtree report measures this GPU: it needs a CUDA GPU with CuPy")
    if fuzz < 0:
        raise BadInput(f"--fuzz must be >= 0, got {fuzz}")
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: exists and is not a directory")
    parts = dict(report.PARTS, tune=partial(report.tune_part, fuzz))
    with Console(stderr=True).status("report") as status:
        r = report.run(out, parts=parts, say=status.update)
    for name, part in r["parts"].items():
        typer.echo(f"{name:12s} {'ok' if part['ok'] else 'FAILED: ' + part['error']} ({part['seconds']} s)")
    typer.echo(f"wrote {out}/report.json, summary.md" + (", report.png" if (out / "report.png").exists() else ""))
    raise typer.Exit(0 if all(p["ok"] for p in r["parts"].values()) else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
