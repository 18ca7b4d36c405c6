"""References for target-verify attention.

- `oracle`: fp64, from the **raw** SGLang tensors (prefix keys through `kv_indices`, draft keys from `k`,
  visibility from `custom_mask` at row stride prefix_len + N) - independent of `kdtree.marshal`.
  Chunked over the prefix so a 128k prefix x 257 nodes x 64 heads stays within a memory budget.
- `emulate_triton`: the numerics of SGLang's Triton `extend_attention_fwd` (bf16 in, fp32 accumulate,
  probabilities rounded to bf16 before P.V, block-wise online softmax): the error floor a bf16 kernel lands near.
- `kernel_model` lives in `kdtree.model`: it consumes the marshaled arguments as the CUDA kernel does.
"""

from __future__ import annotations

import math

import torch

from kdtree.capture import Capture
from kdtree.outputs import AttnOutput


def _cap_logits(s: torch.Tensor, logit_cap: float) -> torch.Tensor:
    return logit_cap * torch.tanh(s / logit_cap) if logit_cap > 0 else s


def _request_inputs(cap: Capture, layer_id: int, b: int, device):
    """Raw per-request tensors: q [N, H, D], prefix K [P, D], draft K [N, D], draft visibility [N, N]."""
    layer = cap.layer(layer_id)
    q0, q1 = int(cap.qo_indptr[b]), int(cap.qo_indptr[b + 1])
    rows = torch.searchsorted(cap.kv_buffer_slots.long(), cap.prefix_slots(b).long())
    prefix_k = layer.kv_buffer_rows[rows, 0].to(device)
    draft_k = layer.k[q0:q1, 0].to(device)
    vis = cap.tree_block(b).to(device)
    return layer.q[q0:q1].to(device), prefix_k, draft_k, vis


def _chunk_len(rows: int, budget_bytes: int, elem_bytes: int) -> int:
    return max(256, budget_bytes // max(1, rows * elem_bytes * 4))


def oracle(
    cap: Capture,
    layer_id: int,
    *,
    device: str | torch.device = "cpu",
    causal: bool = True,
    memory_budget: int = 1 << 30,
) -> AttnOutput:
    """fp64 target-verify attention from the raw capture tensors. Returns fp64 o and lse.

    Prefix tokens are all visible (SGLang skips the prefix columns of the mask); a draft key j is
    visible to node i when mask[i, prefix_len + j] is set and, with `causal` (as SGLang runs), j <= i.
    """
    m = cap.meta
    dv, scale, cap_ = m.v_head_dim, float(m.sm_scale), float(m.logit_cap)
    T, H = cap.num_tokens, m.num_heads
    o = torch.empty(T, H, dv, dtype=torch.float64, device=device)
    lse = torch.empty(T, H, dtype=torch.float64, device=device)
    for b in range(cap.batch_size):
        q, pk, dk, vis = _request_inputs(cap, layer_id, b, device)
        n = q.shape[0]
        qf = q.reshape(n * H, -1).double()
        if causal:
            vis = vis & torch.ones(n, n, dtype=torch.bool, device=device).tril()
        # draft part: exact scores, masked
        sd = _cap_logits((qf @ dk.double().T) * scale, cap_).view(n, H, n)
        sd = sd.masked_fill(~vis[:, None, :], -math.inf).reshape(n * H, n)
        mx = sd.amax(dim=1)
        num = torch.exp(sd - mx[:, None]) @ dk[:, :dv].double()
        den = torch.exp(sd - mx[:, None]).sum(1)
        # prefix part, chunked, merged by running max
        step = _chunk_len(n * H, memory_budget, 8)
        for c0 in range(0, pk.shape[0], step):
            kc = pk[c0 : c0 + step].double()
            s = _cap_logits((qf @ kc.T) * scale, cap_)
            cm = torch.maximum(mx, s.amax(dim=1))
            alpha = torch.exp(mx - cm)
            p = torch.exp(s - cm[:, None])
            num = num * alpha[:, None] + p @ kc[:, :dv]
            den = den * alpha + p.sum(1)
            mx = cm
        q0 = int(cap.qo_indptr[b])
        o[q0 : q0 + n] = (num / den[:, None]).view(n, H, dv)
        lse[q0 : q0 + n] = (mx + torch.log(den)).view(n, H)
    return AttnOutput(o, lse)


def emulate_triton(cap: Capture, layer_id: int, *, device: str | torch.device = "cpu", block: int = 64) -> AttnOutput:
    """SGLang Triton numerics: fp32 scores from bf16 operands, block-wise online softmax in fp32,
    p rounded to bf16 before P.V, fp32 accumulator, bf16 output. Prefix first, then the draft keys."""
    m = cap.meta
    dv, scale, lc = m.v_head_dim, float(m.sm_scale), float(m.logit_cap)
    T, H = cap.num_tokens, m.num_heads
    o = torch.empty(T, H, dv, dtype=torch.bfloat16, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    for b in range(cap.batch_size):
        q, pk, dk, vis = _request_inputs(cap, layer_id, b, device)
        n = q.shape[0]
        qf = q.reshape(n * H, -1).float()
        vis = (vis & torch.ones(n, n, dtype=torch.bool, device=device).tril()).repeat_interleave(H, dim=0)
        mx = torch.full((n * H,), -math.inf, device=device)
        den = torch.zeros(n * H, device=device)
        acc = torch.zeros(n * H, dv, device=device)
        keys = torch.cat([pk, dk])
        p_len = pk.shape[0]
        for c0 in range(0, keys.shape[0], block):
            kc = keys[c0 : c0 + block]
            s = _cap_logits((qf @ kc.float().T) * scale, lc)
            cols = torch.arange(c0, c0 + kc.shape[0], device=device)
            draft_cols = cols >= p_len
            if bool(draft_cols.any()):
                seen = torch.ones_like(s, dtype=torch.bool)
                seen[:, draft_cols] = vis[:, cols[draft_cols] - p_len]
                s = s.masked_fill(~seen, -math.inf)
            cm = torch.maximum(mx, s.amax(dim=1))
            alpha = torch.exp(mx - cm)
            p = torch.exp(s - cm[:, None])
            den = den * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p.to(torch.bfloat16).float() @ kc[:, :dv].float()
            mx = cm
        q0 = int(cap.qo_indptr[b])
        o[q0 : q0 + n] = (acc / den[:, None]).view(n, H, dv).to(torch.bfloat16)
        lse[q0 : q0 + n] = (mx + torch.log(den)).view(n, H)
    return AttnOutput(o, lse)
