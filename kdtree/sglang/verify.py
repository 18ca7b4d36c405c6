"""One verify step as the kdtree backend sees it, SGLang-free: the step's metadata (`VerifyBatch`, taken from
the Triton backend's `forward_metadata` and the `ForwardBatch`), marshaled and planned once per step on the
GPU and launched once per layer (`VerifyRunner`, over `kdtree.serving`: no host sync, CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdtree.device_marshal import marshal_tensors
from kdtree.marshal import VerifyArgs


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


class VerifyRunner:
    """Marshal and plan a step once (on the GPU), run the kdtree kernel for each of its layers. A step is one
    `VerifyBatch` object: the backend builds a new one per step and when a CUDA-graph capture starts, so the
    marshal kernel and the plan are recorded in the graph rather than taken from an eager warm-up."""

    def __init__(self, path=None):
        self._path = path
        self._prepared = None
        self._key = None  # (the VerifyBatch it was prepared for, heads)

    @property
    def path(self):
        """The serving path (compiled on first use; raises KernelCompileError or ImportError)."""
        if self._path is None:
            from kdtree.serving import ServingPath

            self._path = ServingPath()
        return self._path

    def new_step(self) -> None:
        self._prepared = self._key = None

    def run(
        self, batch: VerifyBatch, q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor, *, sm_scale: float, logit_cap: float
    ) -> torch.Tensor:
        """o [T, H, 512] <- attention of q [T, H, 576] over the pool kv_buffer [slots, 1, 576] for this step."""
        from kdtree.kernel import check_inputs

        key = (batch, q.shape[1])
        if self._key is None or self._key[0] is not batch or self._key[1] != key[1]:
            self._prepared = batch.prepare(self.path, q.shape[1])
            self._key = key
        check_inputs(self._prepared.args, q, kv_buffer)
        return self.path.launch(self._prepared, q.contiguous(), kv_buffer, o, sm_scale=sm_scale, logit_cap=logit_cap)
