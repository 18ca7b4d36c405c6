"""One verify step as the kdtree backend sees it, SGLang-free: the step's metadata, marshaled and planned once
per step on the GPU and launched once per layer (`VerifyRunner`, over `kdtree.serving`: no host sync,
CUDA-graph safe). Two forms of the metadata: `TableBatch`, SGLang's page table and lengths as the
`ForwardBatch` holds them (what the backend serves from: no Triton metadata is built), and `VerifyBatch`, the
Triton backend's CSR `forward_metadata` (shadow and capture modes, where Triton runs anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtree.device_marshal import marshal_from_table, marshal_tensors
from kdtree.marshal import VerifyArgs
from kdtree.sglang import log


@dataclass
class VerifyBatch:
    """One TARGET_VERIFY step's metadata, SGLang's names. Device tensors may be longer than the batch (SGLang's
    CUDA-graph buffers); only their leading parts are read."""

    step: int
    qo_indptr: torch.Tensor  # [>= bs+1]
    kv_indptr: torch.Tensor  # [>= bs+1]: cumsum of prefix lengths
    kv_indices: torch.Tensor  # [>= kv_indptr[bs]]: prefix slots
    out_cache_loc: torch.Tensor  # [>= T]: draft slots
    custom_mask: torch.Tensor | None  # flat, [>= mask_indptr[bs]]; None: causal drafts
    mask_indptr: torch.Tensor  # [>= bs+1]
    batch_size: int
    num_draft: int  # N, one for the batch
    kv_capacity: int  # >= kv_indptr[bs] + T: the combined slot list's buffer

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.num_draft

    def prefix_lens(self) -> list[int]:
        """The prefix lengths on the host (reads the device: capture mode and tests only)."""
        kvp = self.kv_indptr[: self.batch_size + 1].cpu().long()
        return (kvp[1:] - kvp[:-1]).tolist()

    def prepare(self, path, num_heads: int):
        """This step marshaled and planned on the GPU by `path` (a `kdtree.serving.ServingPath`)."""
        return path.prepare(
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            self.out_cache_loc,
            self.custom_mask,
            self.mask_indptr,
            batch_size=self.batch_size,
            num_draft=self.num_draft,
            num_heads=num_heads,
            kv_capacity=self.kv_capacity,
        )

    def marshal(self, sm_scale: float, logit_cap: float) -> VerifyArgs:
        """The kernel's arguments in torch ops (`kdtree.device_marshal`; the CPU twin of the marshal kernel)."""
        prefix = self.prefix_lens()
        return marshal_tensors(
            self.qo_indptr[: self.batch_size + 1],
            self.kv_indptr[: self.batch_size + 1],
            self.kv_indices,
            self.out_cache_loc,
            self.custom_mask,
            self.mask_indptr[: self.batch_size + 1],
            num_tokens=self.num_tokens,
            prefix_total=sum(prefix),
            max_prefix_len=max(prefix, default=0),
            max_num_draft=self.num_draft,
            sm_scale=sm_scale,
            logit_cap=logit_cap,
        )


@dataclass
class TableBatch:
    """One TARGET_VERIFY step from SGLang's page table: request b's prefix slots are
    req_to_token[req_pool_indices[b], :seq_lens[b]], its N draft slots out_cache_loc[b N .. (b + 1) N), its mask
    rows custom_mask's (N rows of seq_lens[b] + N). Tensors may be longer than the batch (graph buffers)."""

    step: int
    req_to_token: torch.Tensor  # [rows, width]
    req_pool_indices: torch.Tensor  # [>= bs]
    seq_lens: torch.Tensor  # [>= bs]: prefix lengths
    out_cache_loc: torch.Tensor  # [>= T]
    custom_mask: torch.Tensor | None  # flat; None: causal drafts
    batch_size: int
    num_draft: int
    kv_capacity: int  # >= sum(seq_lens) + T

    def prefix_lens(self) -> list[int]:
        """The prefix lengths on the host (reads the device: tests only)."""
        return self.seq_lens[: self.batch_size].cpu().tolist()

    def prepare(self, path, num_heads: int):
        return path.prepare_table(
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.out_cache_loc,
            self.custom_mask,
            batch_size=self.batch_size,
            num_draft=self.num_draft,
            num_heads=num_heads,
            kv_capacity=self.kv_capacity,
        )

    def marshal(self, sm_scale: float, logit_cap: float) -> VerifyArgs:
        """The kernel's arguments in torch ops (`kdtree.device_marshal.marshal_from_table`, the kernel's twin)."""
        prefix = self.prefix_lens()
        bs = self.batch_size
        return marshal_from_table(
            self.req_to_token,
            self.req_pool_indices[:bs],
            self.seq_lens[:bs],
            self.out_cache_loc,
            self.custom_mask,
            num_draft=self.num_draft,
            prefix_total=sum(prefix),
            max_prefix_len=max(prefix, default=0),
            sm_scale=sm_scale,
            logit_cap=logit_cap,
        )


class VerifyRunner:
    """Marshal and plan a step once (on the GPU), run the kdtree kernel for each of its layers. A step is one
    `VerifyBatch` object: the backend builds a new one per step and when a CUDA-graph capture starts, so the
    marshal kernel and the plan are recorded in the graph rather than taken from an eager warm-up."""

    def __init__(self, path=None, body: str = "default"):
        self._path = path
        self._body = body  # KDTREE_BODY, for the serving path built on first use
        self._prepared = None
        self._key = None  # (the VerifyBatch it was prepared for, heads)

    @property
    def path(self):
        """The serving path (compiled on first use; raises KernelCompileError or ImportError)."""
        if self._path is None:
            from kdtree.serving import ServingPath

            self._path = ServingPath(body=self._body)
            if self._path.fallback:
                log.once("body", f"KDTREE_BODY={self._body}: {self._path.fallback}")
        return self._path

    def new_step(self) -> None:
        self._prepared = self._key = None

    def run(
        self,
        batch: VerifyBatch | TableBatch,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        o: torch.Tensor,
        *,
        sm_scale: float,
        logit_cap: float,
    ) -> torch.Tensor:
        """o [T, H, 512] <- attention of q [T, H, 576] over the pool kv_buffer [slots, 1, 576] for this step."""
        from kdtree.kernel import check_inputs

        prepared = self.prepare(batch, q.shape[1])
        check_inputs(prepared.args, q, kv_buffer)
        return self.path.launch(prepared, q.contiguous(), kv_buffer, o, sm_scale=sm_scale, logit_cap=logit_cap)

    def prepare(self, batch: VerifyBatch | TableBatch, num_heads: int):
        """The step marshaled and planned for `num_heads` heads: once per batch object (the backend calls this
        from its metadata hooks, where SGLang's shared tables may be read; a layer finds it done)."""
        if self._key is None or self._key[0] is not batch or self._key[1] != num_heads:
            self._prepared = batch.prepare(self.path, num_heads)
            self._key = (batch, num_heads)
        return self._prepared
