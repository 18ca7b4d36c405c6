"""Compare an implementation's output with a reference: per layer, request, node and head (elements still
holding the poison of `kdtree.outputs` are counted as unwritten). Running the implementations is
`kdtree.impls.diff_capture`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdtree.capture import Capture
from kdtree.outputs import AttnOutput, unwritten_mask

DEFAULT_TOLERANCE = 1e-2


@dataclass
class LayerDiff:
    layer: int
    max_abs: float
    mean_abs: float
    rel: float
    lse_max_abs: float | None
    nan: int  # NaN/Inf elements the implementation computed
    unwritten: int  # elements still holding the poison
    worst: dict  # request, node, head, depth, abs_diff
    per_request: list[dict]
    tolerance: float
    row_rel: torch.Tensor = field(repr=False)  # [T, H]: ||o - ref|| / ||ref|| per (node, head)
    row_max_abs: torch.Tensor = field(repr=False)  # [T, H]

    @property
    def passed(self) -> bool:
        return self.nan == 0 and self.unwritten == 0 and self.rel <= self.tolerance

    def line(self) -> str:
        s = f"[kdtree] L{self.layer} max_abs_diff={self.max_abs:.4e} mean={self.mean_abs:.4e} rel={self.rel:.4e}"
        if self.lse_max_abs is not None:
            s += f" lse_max_abs={self.lse_max_abs:.4e}"
        if self.nan:
            s += f" nan={self.nan}"
        if self.unwritten:
            s += f" unwritten={self.unwritten}"
        return s

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "max_abs_diff": self.max_abs,
            "mean_abs_diff": self.mean_abs,
            "rel": self.rel,
            "lse_max_abs_diff": self.lse_max_abs,
            "nan": self.nan,
            "unwritten": self.unwritten,
            "worst": self.worst,
            "per_request": self.per_request,
            "tolerance": self.tolerance,
            "passed": self.passed,
        }


def compare(cap: Capture, layer_id: int, out: AttnOutput, ref: AttnOutput, tolerance: float = DEFAULT_TOLERANCE) -> LayerDiff:
    """Diff `out` against `ref` (both [T, H, 512]) for one layer of `cap`."""
    if out.o.shape != ref.o.shape:
        raise ValueError(f"output shape {list(out.o.shape)} differs from the reference's {list(ref.o.shape)}")
    unwritten = unwritten_mask(out.o)
    got = out.o.double()
    want = ref.o.double().to(got.device)
    bad = ~torch.isfinite(got) & ~unwritten
    ok = ~(bad | unwritten)
    err = torch.where(ok, (got - want).abs(), torch.zeros((), dtype=torch.float64, device=got.device))
    ref_norm = want.norm()
    rel = float(err.norm() / ref_norm) if ref_norm > 0 else float(err.norm())
    row_err = err.norm(dim=-1)
    row_rel = row_err / want.norm(dim=-1).clamp_min(1e-300)
    row_max = err.amax(dim=-1)
    # a row with anything unwritten or non-finite is the worst row
    row_bad = (~ok).any(-1)
    score = torch.where(row_bad, torch.full_like(row_max, float("inf")), row_max)
    flat = int(score.argmax())
    t, h = divmod(flat, score.shape[1])
    b = int(torch.searchsorted(cap.qo_indptr.long(), torch.tensor(t), right=True)) - 1
    node = t - int(cap.qo_indptr[b])
    worst = {
        "request": b,
        "node": node,
        "head": h,
        "depth": int(cap.depths(b)[node]),
        "abs_diff": float(row_max[t, h]),
        "rel": float(row_rel[t, h]),
    }
    per_request = []
    for r in range(cap.batch_size):
        sl = slice(int(cap.qo_indptr[r]), int(cap.qo_indptr[r + 1]))
        rn = want[sl].norm()
        per_request.append(
            {
                "request": r,
                "rel": float(err[sl].norm() / rn) if rn > 0 else float(err[sl].norm()),
                "max_abs_diff": float(err[sl].max()),
            }
        )
    lse_diff = None
    if out.lse is not None and ref.lse is not None:
        a, r = out.lse.double(), ref.lse.double().to(out.lse.device)
        both = torch.isfinite(a) & torch.isfinite(r)
        d = torch.where(both, (a - r).abs(), torch.zeros((), dtype=torch.float64, device=a.device))
        mismatch = (torch.isfinite(a) != torch.isfinite(r)).any()
        lse_diff = float("inf") if bool(mismatch) else float(d.max())
    return LayerDiff(
        layer=layer_id,
        max_abs=float(err.max()),
        mean_abs=float(err.sum() / max(1, int(ok.sum()))),
        rel=rel,
        lse_max_abs=lse_diff,
        nan=int(bad.sum()),
        unwritten=int(unwritten.sum()),
        worst=worst,
        per_request=per_request,
        tolerance=tolerance,
        row_rel=row_rel.float().cpu(),
        row_max_abs=row_max.float().cpu(),
    )
