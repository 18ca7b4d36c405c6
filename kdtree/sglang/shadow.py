"""Shadow mode's diff: kdtree's output against the output SGLang served, for one layer of one verify step,
computed on the device and printed as the line kernel engineers grep for:

    [kdtree] L58 max_abs_diff=3.9062e-03 mean=8.2916e-05 rel=2.0325e-03

plus, when rel exceeds the tolerance (or anything is not finite), where the worst element is:
` worst: request=3 node=17 head=5 abs=...`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShadowDiff:
    layer: int
    step: int
    max_abs: float
    mean_abs: float
    rel: float
    nonfinite: int  # elements of kdtree's output that are NaN/Inf
    worst: dict  # request, node, head, abs

    def passed(self, tolerance: float) -> bool:
        return self.nonfinite == 0 and self.rel <= tolerance

    def line(self, tolerance: float, rank: int | None = None) -> str:
        """The printed line; `rank` (above TP 1) names the TP rank after `[kdtree]`, as `[kdtree] TP1 L58 ...`."""
        who = f"TP{rank} " if rank is not None else ""
        s = f"[kdtree] {who}L{self.layer} max_abs_diff={self.max_abs:.4e} mean={self.mean_abs:.4e} rel={self.rel:.4e}"
        if self.nonfinite:
            s += f" nonfinite={self.nonfinite}"
        if not self.passed(tolerance):
            w = self.worst
            s += f" worst: request={w['request']} node={w['node']} head={w['head']} abs={w['abs']:.4e} (step {self.step})"
        return s


def shadow_diff(out: torch.Tensor, ref: torch.Tensor, qo_indptr: torch.Tensor, *, layer: int, step: int) -> ShadowDiff:
    """Compare `out` [T', H, D] with `ref` (the same elements in any shape) over the first T = qo_indptr[-1]
    rows (SGLang's buffers may be padded). Reads a few numbers back from the device."""
    T = int(qo_indptr[-1])
    o = out[:T].double()
    r = ref[:T].double().view(o.shape)
    finite = torch.isfinite(o)
    err = torch.where(finite, (o - r).abs(), torch.zeros((), dtype=o.dtype, device=o.device))
    ref_norm = r.norm()
    rel = err.norm() / ref_norm if ref_norm > 0 else err.norm()
    row_score = torch.where(finite.all(-1), err.amax(-1), torch.full_like(err[..., 0], float("inf")))
    flat = int(row_score.argmax())
    t, h = divmod(flat, row_score.shape[1])
    req = int(torch.searchsorted(qo_indptr.long().cpu(), torch.tensor(t), right=True)) - 1
    return ShadowDiff(
        layer=layer,
        step=step,
        max_abs=float(err.max()) if err.numel() else 0.0,
        mean_abs=float(err.mean()) if err.numel() else 0.0,
        rel=float(rel),
        nonfinite=int((~finite).sum()),
        worst={"request": req, "node": t - int(qo_indptr[req]), "head": h, "abs": float(row_score.flatten()[flat])},
    )
