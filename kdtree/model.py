"""A torch model of the CUDA verify kernel: it consumes the **marshaled** arguments exactly as the kernel
does - every key read from the (NaN-poisoned) pool through the combined slot list, draft visibility from
the packed tree mask, prefix always visible - with the kernel's numerics (bf16 operands, fp32 scores and
accumulation, bf16 output, natural-log LSE). It is how marshaling and the injected faults are tested
without a GPU, and the default `--impl` of `kdtree diff` where no GPU is present.
"""

from __future__ import annotations

import math

import torch

from kdtree.marshal import VerifyArgs
from kdtree.outputs import AttnOutput


def _draft_visible(tree_words: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """[rows, W] int32 words, draft indices j [C] -> [rows, C] bool."""
    w = tree_words[:, (j // 32)]
    return ((w >> (j % 32).to(torch.int32)) & 1).bool()


def kernel_model(
    args: VerifyArgs,
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    *,
    v_head_dim: int = 512,
    chunk: int = 4096,
) -> AttnOutput:
    """o [T, H, v_head_dim] bf16 and lse [T, H] fp32 from the kernel arguments and the pool."""
    T, H, _ = q.shape
    device = q.device
    o = torch.empty(T, H, v_head_dim, dtype=torch.bfloat16, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    qo = args.qo_indptr.tolist()
    kvp = args.combined_kv_indptr.tolist()
    for b in range(args.batch_size):
        q0, q1 = qo[b], qo[b + 1]
        n = q1 - q0
        slots = args.combined_kv_indices[kvp[b] : kvp[b + 1]].long().to(device)
        p = int(args.prefix_lens[b])
        words = args.tree_mask[q0:q1].to(device).repeat_interleave(H, dim=0)  # row = node * H + head
        qf = q[q0:q1].reshape(n * H, -1).float()
        mx = torch.full((n * H,), -math.inf, device=device)
        den = torch.zeros(n * H, device=device)
        acc = torch.zeros(n * H, v_head_dim, device=device)
        for c0 in range(0, slots.numel(), chunk):
            kv = kv_buffer[slots[c0 : c0 + chunk], 0].float()
            s = (qf @ kv.T) * args.sm_scale
            if args.logit_cap > 0:
                s = args.logit_cap * torch.tanh(s / args.logit_cap)
            t = torch.arange(c0, c0 + kv.shape[0], device=device)
            draft = t >= p
            if bool(draft.any()):
                seen = torch.ones_like(s, dtype=torch.bool)
                seen[:, draft] = _draft_visible(words, t[draft] - p)
                s = s.masked_fill(~seen, -math.inf)
            cm = torch.maximum(mx, s.amax(dim=1))
            safe = torch.where(torch.isinf(cm), torch.zeros_like(cm), cm)  # rows with nothing visible yet
            alpha = torch.exp(mx - safe)
            pr = torch.exp(s - safe[:, None])
            den = den * alpha + pr.sum(1)
            acc = acc * alpha[:, None] + pr @ kv[:, :v_head_dim]
            mx = cm
        empty = den == 0  # no visible key at all (only under injected faults): write 0, lse = -inf
        out = torch.where(empty[:, None], torch.zeros_like(acc), acc / den.clamp_min(1e-30)[:, None])
        o[q0:q1] = out.view(n, H, v_head_dim).to(torch.bfloat16)
        lse[q0:q1] = torch.where(empty, torch.full_like(mx, -math.inf), mx + torch.log(den)).view(n, H)
    return AttnOutput(o, lse)
