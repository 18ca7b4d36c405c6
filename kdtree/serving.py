"""The serving path: one verify step from SGLang's metadata tensors to the kernel's output without a host sync
and with shapes fixed by (batch size, N, heads), so a server can record it in a CUDA graph and replay it with
other prefix lengths.

Per step, `ServingPath.prepare` launches the marshal kernel (`kernels/verify_mla_marshal.cu`: the combined slot
list and the packed tree bits, what `kdtree.marshal` computes) and plans on the GPU (`kdtree.device_plan`);
per layer, `launch` runs the verify kernel on that plan. One configuration (the target's default) and a fixed
grid of one block per SM slot, so an eager step and its graph replay run the same plan and give the same bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from kdtree.device_plan import PlanShape, plan_on_device
from kdtree.kernel import KERNEL_DIR, KernelConfig, LaunchPlan, VerifyKernel, Workspace
from kdtree.marshal import VerifyArgs

MARSHAL_SOURCE = KERNEL_DIR / "verify_mla_marshal.cu"
MARSHAL_THREADS = 256
MARSHAL_BLOCKS_Y = 8  # blocks per request (a 128k prefix: 64 slots a thread)


@dataclass
class PreparedStep:
    """A step's kernel arguments, plan and workspace on the device, shared by its layers."""

    args: VerifyArgs
    plan: LaunchPlan
    workspace: Workspace


class ServingPath:
    """The marshal kernel, the device planner and the verify kernel, for one configuration."""

    def __init__(self, kernel: VerifyKernel | None = None, config: KernelConfig | None = None):
        import cupy

        self.kernel = kernel or VerifyKernel.get()
        self.config = config or self.kernel.configs[0]
        self.kernel.compiled(self.config)
        self.grid = self.kernel.num_sms * self.config.blocks_per_sm
        module = cupy.RawModule(code=MARSHAL_SOURCE.read_text(), options=("-std=c++17",))
        self._marshal = {
            torch.int64: module.get_function("verify_mla_marshal_i64"),
            torch.int32: module.get_function("verify_mla_marshal_i32"),
        }

    def prepare(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        out_cache_loc: torch.Tensor,
        custom_mask: torch.Tensor | None,
        mask_indptr: torch.Tensor,
        *,
        batch_size: int,
        num_draft: int,
        num_heads: int,
        kv_capacity: int,
    ) -> PreparedStep:
        """Marshal and plan one step (device work only: graph-capturable). SGLang's tensors as its Triton backend
        holds them (buffers may be longer than the batch); `kv_capacity` >= kv_indptr[bs] + bs * N bounds the
        combined slot list."""
        dev, bs, n = qo_indptr.device, batch_size, num_draft
        words = (n + 31) // 32
        qo = qo_indptr[: bs + 1].to(torch.int32)
        kvp = kv_indptr[: bs + 1].to(torch.int32)
        combined_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
        combined = torch.empty(kv_capacity, dtype=torch.int32, device=dev)
        prefix_lens = torch.empty(bs, dtype=torch.int32, device=dev)
        tree_mask = torch.empty(bs * n, words, dtype=torch.int32, device=dev)
        indices = kv_indices if kv_indices.dtype in self._marshal else kv_indices.to(torch.int64)
        loc = out_cache_loc.to(torch.int64)
        mask = None if custom_mask is None else custom_mask.view(torch.uint8)
        mask_ptr = mask_indptr[: bs + 1].to(torch.int64)
        ptr = lambda t: np.uint64(0 if t is None else t.data_ptr())  # noqa: E731
        with self.kernel.cupy_stream(torch.cuda.current_stream()):
            self._marshal[indices.dtype](
                (bs, MARSHAL_BLOCKS_Y, 1),
                (MARSHAL_THREADS, 1, 1),
                (
                    ptr(qo),
                    ptr(kvp),
                    ptr(indices),
                    ptr(loc),
                    ptr(mask),
                    ptr(mask_ptr),
                    np.int32(words),
                    ptr(combined_indptr),
                    ptr(combined),
                    ptr(prefix_lens),
                    ptr(tree_mask),
                    np.int32(bs),
                ),
            )
        args = VerifyArgs(
            qo_indptr=qo,
            combined_kv_indptr=combined_indptr,
            combined_kv_indices=combined,
            prefix_lens=prefix_lens,
            tree_mask=tree_mask,
            max_num_draft=n,
            max_kv_len=kv_capacity,
            sm_scale=1.0,
            logit_cap=0.0,
        )
        shape = PlanShape(bs, n, num_heads, self.config, self.grid)
        plan = plan_on_device(qo, combined_indptr, shape, mask_words=words)
        return PreparedStep(args, plan, Workspace.for_plan(plan, dev))

    def launch(
        self,
        step: PreparedStep,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        o: torch.Tensor,
        *,
        sm_scale: float,
        logit_cap: float = 0.0,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o [T, H, 512] <- one layer's verify attention (q [T, H, 576], the pool [slots, 1, 576])."""
        args = dataclasses.replace(step.args, sm_scale=float(sm_scale), logit_cap=float(logit_cap))
        self.kernel.launch(step.plan, args, q, kv_buffer, o, lse, step.workspace)
        return o
