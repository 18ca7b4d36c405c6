"""SGLang's TARGET_VERIFY metadata tensors -> the verify kernel's arguments, in torch ops on the tensors' own
device (the serving path: no per-request Python loop, no copy of the metadata to the host).

`marshal_tensors` reads the Triton backend's CSR metadata; `marshal_from_table` reads SGLang's page table
(`req_to_token` rows of `req_pool_indices`, `seq_lens`) as the kdtree backend's own metadata hook does
(`kernels/verify_mla_marshal.cu`, `verify_mla_marshal_table_*`). Both compute what `kdtree.marshal` computes step by step - the combined slot list `kv_indices[prefix of b] ++
out_cache_loc[drafts of b]` and the draft block of `custom_mask` (row stride `prefix_len + N`) packed to bits -
and gives the same bits (tested on every shipped capture and on fuzz batches). `kdtree.marshal` stays the
readable path the notebooks step through.

The host supplies the few integers that size the outputs (the prefix total and the largest N), which SGLang
already has on the host (`seq_lens_sum`, `seq_lens_cpu`, the number of draft tokens), so nothing here waits
for the GPU. Buffers may be oversized, as SGLang's CUDA-graph buffers are: only their leading parts are read.
"""

from __future__ import annotations

import torch

from kdtree.marshal import VerifyArgs


def _as_int32_words(bits: torch.Tensor) -> torch.Tensor:
    """[rows, W * 32] bool -> [rows, W] int32, bit j % 32 of word j // 32 (as `kdtree.marshal.pack_bits`)."""
    rows, width = bits.shape
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    words = (bits.view(rows, width // 32, 32).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def marshal_tensors(
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    out_cache_loc: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor,
    *,
    num_tokens: int,
    prefix_total: int,
    max_prefix_len: int,
    max_num_draft: int,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> VerifyArgs:
    """The kernel's arguments for one verify step, on the device of `qo_indptr`.

    `qo_indptr`, `kv_indptr` [bs+1], `mask_indptr` [bs+1] and the flat `kv_indices`, `out_cache_loc`,
    `custom_mask` are SGLang's (`custom_mask` None: each request's drafts form a causal chain).
    `num_tokens` = qo_indptr[bs], `prefix_total` = kv_indptr[bs], `max_prefix_len` and `max_num_draft` are
    host integers.
    """
    dev = qo_indptr.device
    bs = qo_indptr.numel() - 1
    qo = qo_indptr.long()
    kvp = kv_indptr[: bs + 1].long()
    prefix = kvp[1:] - kvp[:-1]
    num_draft = qo[1:] - qo[:-1]
    combined_indptr = kvp + qo

    # combined slot list: position j of request r is a prefix slot or a draft slot
    tokens = torch.arange(num_tokens, device=dev)
    t_req = torch.searchsorted(qo[1:], tokens, right=True)
    t_node = tokens - qo[t_req]
    total = prefix_total + num_tokens
    j = torch.arange(total, device=dev)
    j_req = torch.searchsorted(combined_indptr[1:], j, right=True)
    off = j - combined_indptr[j_req]
    in_prefix = off < prefix[j_req]
    prefix_src = kv_indices[: max(prefix_total, 1)] if kv_indices.numel() else torch.zeros(1, dtype=torch.long, device=dev)
    from_prefix = prefix_src[(kvp[j_req] + off).clamp(max=max(prefix_total - 1, 0))]
    from_draft = out_cache_loc[(qo[j_req] + off - prefix[j_req]).clamp(min=0)]
    combined = torch.where(in_prefix, from_prefix.long(), from_draft.long())

    # tree bits: token t (node i of request r) sees draft node c of r where its mask row says so
    words = (max_num_draft + 31) // 32
    cols = torch.arange(words * 32, device=dev)
    col_live = cols[None, :] < num_draft[t_req][:, None]
    if custom_mask is None:
        bits = (cols[None, :] <= t_node[:, None]) & col_live
    else:
        p = prefix[t_req]
        row_start = mask_indptr[t_req].long() + t_node * (p + num_draft[t_req]) + p
        flat = (row_start[:, None] + cols[None, :]).clamp(max=custom_mask.numel() - 1)
        bits = (custom_mask[flat] != 0) & col_live
    return VerifyArgs(
        qo_indptr=qo_indptr.to(torch.int32),
        combined_kv_indptr=combined_indptr.to(torch.int32),
        combined_kv_indices=combined.to(torch.int32),
        prefix_lens=prefix.to(torch.int32),
        tree_mask=_as_int32_words(bits),
        max_num_draft=int(max_num_draft),
        max_kv_len=int(max_prefix_len + max_num_draft),
        sm_scale=float(sm_scale),
        logit_cap=float(logit_cap),
    )


def table_metadata(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, num_draft: int, prefix_total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qo_indptr, kv_indptr, kv_indices, mask_indptr) the Triton backend builds for TARGET_VERIFY from SGLang's
    page table: kv_indices = req_to_token[req_pool_indices[b], :seq_lens[b]] concatenated, one mask row of
    seq_lens + N per draft token."""
    dev, bs, n = seq_lens.device, seq_lens.numel(), int(num_draft)
    lens = seq_lens.long()
    zero = lens.new_zeros(1)
    kv_indptr = torch.cat([zero, torch.cumsum(lens, 0)])
    qo_indptr = torch.arange(bs + 1, device=dev, dtype=torch.int64) * n
    mask_indptr = torch.cat([zero, torch.cumsum(n * (lens + n), 0)])
    j = torch.arange(prefix_total, device=dev)
    j_req = torch.searchsorted(kv_indptr[1:], j, right=True)
    kv_indices = req_to_token[req_pool_indices.long()[j_req], j - kv_indptr[j_req]]
    return qo_indptr, kv_indptr, kv_indices, mask_indptr


def marshal_from_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    custom_mask: torch.Tensor | None,
    *,
    num_draft: int,
    prefix_total: int,
    max_prefix_len: int,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> VerifyArgs:
    """The kernel's arguments from SGLang's page table (`seq_lens` [bs]: prefix lengths, TARGET_VERIFY's),
    N draft tokens a request; `prefix_total` = sum(seq_lens) and `max_prefix_len` are host integers."""
    qo, kvp, kv_indices, mask_indptr = table_metadata(req_to_token, req_pool_indices, seq_lens, num_draft, prefix_total)
    return marshal_tensors(
        qo,
        kvp,
        kv_indices,
        out_cache_loc,
        custom_mask,
        mask_indptr,
        num_tokens=seq_lens.numel() * int(num_draft),
        prefix_total=prefix_total,
        max_prefix_len=max_prefix_len,
        max_num_draft=num_draft,
        sm_scale=sm_scale,
        logit_cap=logit_cap,
    )
