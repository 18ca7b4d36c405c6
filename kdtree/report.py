"""`kdtree report`: what the owner of a GPU nobody here has (an RTX PRO 6000, say) runs once and sends back, in one
folder: the environment, the self-check, the compile report, the ceilings, the bench against SGLang's Triton
kernel (where it imports), and the planner's picks before and after `kdtree tune`'s fit - as report.json, a
figure (report.png) and a short summary.md.

Each part runs on its own: one that fails is recorded with its error and traceback and the others still run, so a
report always says what it could measure. report.json is rewritten after each part (an interrupted run leaves the
parts done). The tuning file is not written: `kdtree tune` does that when asked.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable

from kdtree.environment import describe
from kdtree.files import write_text_atomic

FORMAT = "kdtree-report/2"  # 2: the environment as kdtree.environment records it


def selfcheck_part() -> dict:
    from kdtree import selfcheck

    outcome = selfcheck.ensure("cuda", force=True, honour_skip=False)
    return {"verdict": outcome.verdict.to_json(), "text": selfcheck.format_verdict(outcome.verdict), "notes": outcome.notes}


def compile_part() -> dict:
    from kdtree.kernel import KernelConfig, compile_report
    from kdtree.kernel.config import target_arch

    arch = target_arch()
    rows = [r for c in KernelConfig.candidates(arch) for r in compile_report(arch, c)]
    return {"target": arch, "lines": [r.line() for r in rows], "ok": all(r.ok for r in rows)}


def bench_part() -> dict:
    from kdtree import bench

    return bench.run(log=lambda _: None)


def tune_part(fuzz: int = 40) -> dict:
    from kdtree import tune

    result = tune.tune(tune.batches_to_time([], fuzz))
    result.pop("_model")
    return result


PARTS: dict[str, Callable[[], dict]] = {
    "environment": describe,
    "selfcheck": selfcheck_part,
    "compile": compile_part,
    "bench": bench_part,
    "tune": tune_part,
}


def _write_json(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str))


def run(out_dir: Path, *, parts: dict[str, Callable[[], dict]] | None = None, say=lambda _: None) -> dict:
    """Every part in order, each recorded (with its seconds, or its error and traceback); then the summary and
    the figure. Returns the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"format": FORMAT, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}
    for name, fn in (parts or PARTS).items():
        say(f"report: {name}")
        t0 = time.perf_counter()
        try:
            report["parts"][name] = {"ok": True, "result": fn()}
        except Exception as e:  # noqa: BLE001 - one part's failure is a finding; the others still run
            report["parts"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        _write_json(out_dir / "report.json", report)
    (out_dir / "summary.md").write_text(summary(report))
    bench, tune = (report["parts"].get(k, {}) for k in ("bench", "tune"))
    bench, tune = (p["result"] if p.get("ok") else None for p in (bench, tune))
    from kdtree.plots import report_figure, tuned_rows
    from kdtree.tune import PICK_MARGIN

    if (bench and bench.get("cases")) or tuned_rows(tune):
        env = report["parts"].get("environment", {}).get("result") or {}
        title = f"kdtree report: {env.get('gpu') or 'GPU unknown'} ({env.get('capability', '?')}), {report['started']}"
        report_figure(bench, tune, title, margin=PICK_MARGIN).savefig(out_dir / "report.png", dpi=110, bbox_inches="tight")
    return report


def summary(report: dict) -> str:
    """The report in a page of markdown: what ran, what it found, what failed."""
    parts = report["parts"]
    lines = ["# kdtree report", ""]
    env = parts.get("environment", {}).get("result", {})
    if env:
        lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items() if v not in (None, {})] + [""]
    for name, part in parts.items():
        head = f"## {name} ({part['seconds']} s)"
        if not part["ok"]:
            lines += [head, "", f"FAILED: `{part['error']}` (traceback in report.json)", ""]
            continue
        r = part["result"]
        if name == "selfcheck":
            lines += [head, "", "```", r["text"], "```", ""]
        elif name == "compile":
            lines += [
                head,
                "",
                f"target {r['target']}: {'fits' if r['ok'] else 'DOES NOT FIT'}",
                "",
                "```",
                *r["lines"],
                "```",
                "",
            ]
        elif name == "bench":
            from kdtree.bench import summary_table

            c = r.get("ceilings", {})
            nan = float("nan")
            lines += [
                head,
                "",
                f"ceilings: bf16 matmul {c.get('matmul_bf16_tflops', nan):.0f} TFLOP/s, copy {c.get('copy_tbps', nan):.2f} TB/s, "
                f"mma.sync raw {c.get('mma_sync_raw_tflops', nan):.0f} TFLOP/s",
                "",
                "```",
                summary_table(r),
                "```",
                "",
            ]
        elif name == "tune":
            from kdtree.tune import PICK_MARGIN

            s, margin = r["summary"], f"{100 * PICK_MARGIN:g} %"
            lines += [head, ""]
            within, n = s.get("within_margin", {}), len(s.get("rows", []))
            lines += [
                f"- {k} picks over the fastest plan: geomean {s[k]['geomean']:.3f}, worst {s[k]['worst']:.3f}"
                + (f"; within {margin} on {within[k]} of {n} batches" if k in within else "")
                for k in ("shipped", "tuned")
                if s.get(k, {}).get("geomean") is not None
            ]
            if r.get("picks"):
                lines.append(f"- measured picks for {len(r['picks'])} shape class(es) the fit misses by over {margin}")
            lines.append("")
    return "\n".join(lines)
