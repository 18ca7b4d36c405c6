"""FlashInfer's MLA paged-attention wrapper with a causal mask: what a chain draft (EAGLE with topk 1) can run
instead of a tree-verify kernel, timed beside kdtree on the chain-shaped bench cases (`kdtree bench --chain`).

FlashInfer is not a dependency of kdtree. `load()` says whether it imports; `causal_step` plans its
`BatchMLAPagedAttentionWrapper` on a batch with page size 1 (the combined slot list as the page list) and a causal
mask, which is a chain's tree mask: draft node i of a request sees its prefix and drafts 0..i. Query and pool go in
packed (576 = 512 latent + 64 rope, kdtree's own layout), so both kernels read the same tensors."""

from __future__ import annotations

import torch

from kdtree.capture import Capture
from kdtree.marshal import VerifyArgs

BACKENDS = ("fa3", "fa2")  # FlashInfer's Hopper MLA kernel, then its portable one
WORKSPACE_BYTES = 128 << 20  # what FlashInfer's docs suggest for the float workspace


def load():
    """(the flashinfer module or None, what was found: its version, or why it does not import)."""
    try:
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure of an optional import is reported, not raised
        return None, f"not importable: {type(e).__name__}: {e}"
    return flashinfer, f"flashinfer {flashinfer.__version__}"


def is_chain(cap: Capture) -> bool:
    """Every request's tree block is lower-triangular and full (node i sees nodes 0..i): the causal mask."""
    for b in range(cap.batch_size):
        block = cap.tree_block(b)
        n = block.shape[0]
        if not torch.equal(block.bool(), torch.ones(n, n, dtype=torch.bool).tril()):
            return False
    return True


def causal_step(cap: Capture, args: VerifyArgs, q: torch.Tensor, pool: torch.Tensor, flashinfer, backends=BACKENDS):
    """(step, o, info): step(q, pool) runs FlashInfer's MLA wrapper, causal, on `cap`'s batch (marshaled as `args`)
    with these inputs (q [T, H, 576], pool [slots, 1, 576], bf16 on the GPU), into o. The first of `backends` that
    plans and runs on (q, pool) is kept (`info["backend"]`; the others' errors in `info["refused"]`). Raises
    ValueError for a batch whose draft is not a chain (the causal mask would differ from its tree mask) and
    RuntimeError where no backend runs."""
    if not is_chain(cap):
        raise ValueError("FlashInfer's causal mask is a chain's tree mask only: this batch's draft is not a chain")
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    dev = "cuda"
    T, H = cap.num_tokens, cap.meta.num_heads
    qo, kvp = args.qo_indptr.to(dev, torch.int32), args.combined_kv_indptr.to(dev, torch.int32)
    kv_idx = args.combined_kv_indices.to(dev, torch.int32)
    kv_len = (kvp[1:] - kvp[:-1]).contiguous()
    o = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    refused = {}
    for backend in backends:
        try:
            wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=backend)
            meta = flashinfer.mla.MLAPlanMetadata.csr(qo, kvp, kv_idx, kv_len)
            wrapper.plan(
                metadata=meta,
                num_heads=H,
                head_dim_ckv=512,
                head_dim_kpe=64,
                page_size=1,
                causal=True,
                sm_scale=args.sm_scale,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
            )
            step = lambda q, pool, w=wrapper: w.run(query=q, kv_cache=pool, out=o)  # noqa: E731
            step(q, pool)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - try the next backend; the record says why this one did not run
            refused[backend] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        return step, o, {"backend": backend, "refused": refused}
    raise RuntimeError(f"no FlashInfer MLA backend ran: {refused}")
