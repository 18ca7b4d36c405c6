"""What a server's log says about kdtree: shadow lines, kdtree's own `[kdtree]` lines (sorted into what a mode
expects and what means kdtree fell back), SGLang's CUDA-graph capture of target verify, and errors."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
# (above TP 1 the backend names the rank: `[kdtree] TP1 L58 max_abs_diff=...`; its lines are prints, which SGLang's
# log format does not prefix)
SHADOW_RE = re.compile(rf"\[kdtree\] (?:TP(\d+) )?L(\d+) max_abs_diff={_NUM} mean={_NUM} rel={_NUM}(?: nonfinite=(\d+))?")
KDTREE_RE = re.compile(r"\[kdtree\] (.*)$")
GRAPH_RE = re.compile(r"Capture target verify CUDA graph end\. bs=\[([^\]]*)\]")
# kdtree's lines that say it did not do what it was asked (the step went to Triton, or capture stopped early)
FALLBACK_MARKS = ("kdtree failed", "could not prepare", "shadow failed", "capture failed", "capture stopped", "self-check FAILED")
SELFCHECK_MARK = "self-check"  # the backend's one line on the kernel's self-check (passed, FAILED, skipped)
BUDGET_MARKS = ("KDTREE_CAPTURE_MAX_FILES budget", "past KDTREE_CAPTURE_MAX_BYTES")  # capture stopped as asked
SERVED_MARK = "serving: first verify step"  # kdtree's serve path ran (backend.py logs it once)
REPLAY_MARK = "serving: replaying CUDA graphs"  # a graph kdtree captured was replayed
ERROR_RE = re.compile(r"Traceback \(most recent call last\)|\b(?:CUDA error|RuntimeError|AssertionError)\b")


@dataclass
class ShadowLine:
    layer: int
    max_abs: float
    mean: float
    rel: float
    nonfinite: int
    rank: int = 0  # the TP rank that printed it (named above TP 1)


@dataclass
class LogScan:
    shadow: list[ShadowLine] = field(default_factory=list)
    kdtree_lines: list[str] = field(default_factory=list)  # every other `[kdtree] ...` line, in order
    graph_batch_sizes: list[int] | None = None  # SGLang's target-verify CUDA graphs, when captured
    errors: list[str] = field(default_factory=list)

    @property
    def fallbacks(self) -> list[str]:
        """kdtree's lines that mean a fallback or a stop it was not asked for."""
        return [
            line
            for line in self.kdtree_lines
            if any(m in line for m in FALLBACK_MARKS) and not any(b in line for b in BUDGET_MARKS)
        ]

    @property
    def budget_stops(self) -> list[str]:
        return [line for line in self.kdtree_lines if any(b in line for b in BUDGET_MARKS)]

    @property
    def served(self) -> bool:
        return any(SERVED_MARK in line for line in self.kdtree_lines)

    @property
    def replayed(self) -> bool:
        return any(REPLAY_MARK in line for line in self.kdtree_lines)

    @property
    def selfcheck(self) -> str | None:
        return next((line for line in self.kdtree_lines if SELFCHECK_MARK in line), None)

    @property
    def worst_rel(self) -> float | None:
        return max((s.rel for s in self.shadow), default=None)

    @property
    def nonfinite(self) -> int:
        return sum(s.nonfinite for s in self.shadow) + sum(1 for s in self.shadow if not math.isfinite(s.rel))

    def summary(self) -> dict:
        return {
            "shadow_lines": len(self.shadow),
            "shadow_layers": sorted({s.layer for s in self.shadow}),
            "shadow_ranks": sorted({s.rank for s in self.shadow}),
            "worst_rel": self.worst_rel,
            "nonfinite": self.nonfinite,
            "graph_batch_sizes": self.graph_batch_sizes,
            "kdtree_served": self.served,
            "kdtree_graph_replayed": self.replayed,
            "selfcheck": self.selfcheck,
            "fallbacks": self.fallbacks,
            "capture_budget_stops": self.budget_stops,
            "kdtree_lines": self.kdtree_lines,
            "errors": self.errors[:20],
        }


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def scan(text: str) -> LogScan:
    """Read a server log (all processes' stdout and stderr in one file)."""
    out = LogScan()
    for line in text.splitlines():
        found = list(SHADOW_RE.finditer(line))  # (two processes' prints may share a line)
        for m in found:
            rank, layer, max_abs, mean, rel, nonfinite = m.groups()
            row = ShadowLine(int(layer), _float(max_abs), _float(mean), _float(rel), int(nonfinite or 0), int(rank or 0))
            out.shadow.append(row)
        if found:
            continue
        m = KDTREE_RE.search(line)
        if m:
            out.kdtree_lines.append(m.group(1).strip())
            continue
        m = GRAPH_RE.search(line)
        if m:
            sizes = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
            out.graph_batch_sizes = sorted(set(out.graph_batch_sizes or []) | set(sizes))
            continue
        if ERROR_RE.search(line):
            out.errors.append(line.strip()[:300])
    return out
