"""One verify step as the kdtree backend sees it, SGLang-free: the step's metadata (`VerifyBatch`, taken from
the Triton backend's `forward_metadata` and the `ForwardBatch`), marshaled and planned once per step and
launched once per layer (`VerifyRunner`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kdtree.device_marshal import marshal_tensors
from kdtree.marshal import VerifyArgs


@dataclass
class VerifyBatch:
    """One TARGET_VERIFY step's metadata, SGLang's names; device tensors cut to their live parts."""

    step: int
    qo_indptr: torch.Tensor  # [bs+1]
    kv_indptr: torch.Tensor  # [bs+1]: cumsum of prefix lengths
    kv_indices: torch.Tensor  # [>= kv_indptr[bs]]: prefix slots
    out_cache_loc: torch.Tensor  # [T]: draft slots
    custom_mask: torch.Tensor | None  # flat, [>= mask_indptr[bs]]; None: causal drafts
    mask_indptr: torch.Tensor  # [bs+1]
    prefix_lens: list[int]  # on the host (seq_lens_cpu)
    num_draft: int  # N, one for the batch

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.num_draft

    @property
    def prefix_total(self) -> int:
        return sum(self.prefix_lens)

    def marshal(self, sm_scale: float, logit_cap: float) -> VerifyArgs:
        """The kernel's arguments on the metadata's device (`kdtree.device_marshal`)."""
        return marshal_tensors(
            self.qo_indptr, self.kv_indptr, self.kv_indices, self.out_cache_loc, self.custom_mask, self.mask_indptr,
            num_tokens=self.num_tokens, prefix_total=self.prefix_total, max_prefix_len=max(self.prefix_lens, default=0),
            max_num_draft=self.num_draft, sm_scale=sm_scale, logit_cap=logit_cap,
        )

    def host_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`qo_indptr` and `combined_kv_indptr` on the host, what the planner reads (no device sync)."""
        n = self.num_draft
        qo = torch.arange(self.batch_size + 1, dtype=torch.int32) * n
        combined = torch.tensor([0] + [p + n for p in self.prefix_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
        return qo, combined


@dataclass
class PreparedStep:
    """A step's arguments, plan and workspace on the device, shared by its layers."""

    key: tuple
    args: VerifyArgs
    plan: object  # kdtree.kernel.LaunchPlan
    workspace: object  # kdtree.kernel.Workspace


class VerifyRunner:
    """Marshal and plan a step once, run the kdtree kernel for each of its layers."""

    def __init__(self, kernel=None):
        self._kernel = kernel
        self._prepared: PreparedStep | None = None

    @property
    def kernel(self):
        """The compiled kernel (compiled on first use; raises KernelCompileError or ImportError)."""
        if self._kernel is None:
            from kdtree.kernel import VerifyKernel

            self._kernel = VerifyKernel.get()
        return self._kernel

    def prepare(self, batch: VerifyBatch, num_heads: int, sm_scale: float, logit_cap: float) -> PreparedStep:
        key = (batch.step, num_heads, float(sm_scale), float(logit_cap))
        if self._prepared is None or self._prepared.key != key:
            from kdtree.kernel import Workspace

            args = batch.marshal(sm_scale, logit_cap)
            qo, combined = batch.host_lengths()
            plan = self.kernel.plan(dataclasses.replace(args, qo_indptr=qo, combined_kv_indptr=combined), num_heads)
            device = batch.qo_indptr.device
            plan = plan.to(device)
            self._prepared = PreparedStep(key, args, plan, Workspace.for_plan(plan, device))
        return self._prepared

    def run(self, batch: VerifyBatch, q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor, *,
            sm_scale: float, logit_cap: float) -> torch.Tensor:
        """o [T, H, 512] <- attention of q [T, H, 576] over the pool kv_buffer [slots, 1, 576] for this step."""
        from kdtree.kernel import check_inputs

        step = self.prepare(batch, q.shape[1], sm_scale, logit_cap)
        check_inputs(step.args, q, kv_buffer)
        self.kernel.launch(step.plan, step.args, q.contiguous(), kv_buffer, o, None, step.workspace)
        return o
