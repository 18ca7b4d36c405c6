"""The serving path: one verify step from SGLang's metadata tensors to the kernel's output without a host sync
and with shapes fixed by (batch size, N, heads), so a server can record it in a CUDA graph and replay it with
other prefix lengths.

Per step, `ServingPath.prepare` launches the marshal kernel (`kernels/verify_mla_marshal.cu`: the combined slot
list and the packed tree bits, what `kdtree.marshal` computes) and plans on the GPU (`kdtree.device_plan`);
per layer, `launch` runs the verify kernel on that plan. One configuration (the target's default, or the one
`serving_config` names) and a fixed grid of one block per SM slot, so an eager step and its graph replay run the same plan and give the same bits.

Two metadata sources: `prepare` reads the Triton backend's CSR metadata (kv_indptr, kv_indices, mask_indptr);
`prepare_table` reads SGLang's page table (req_to_token rows, seq_lens) and needs no Triton metadata at all,
which is what keeps a step's host work to a few launches. Outside a CUDA-graph capture the plan's ~30 torch
ops are replayed from a small graph per plan shape (`PlanGraph`, captured on a shape's first step), so an
eager step's host cost does not grow with the op count either; inside a capture they are recorded as they are.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kdtree.device_plan import PlanShape, plan_on_device
from kdtree.kernel import KERNEL_DIR, KernelConfig, LaunchPlan, VerifyKernel, Workspace, device_ptr
from kdtree.marshal import VerifyArgs

MARSHAL_SOURCE = KERNEL_DIR / "verify_mla_marshal.cu"
MARSHAL_THREADS = 256
MARSHAL_BLOCKS_Y = 8  # blocks per request (a 128k prefix: 64 slots a thread)
PLAN_GRAPHS = 64  # plan shapes kept (batch size x N x heads), least recently used dropped


@dataclass
class PreparedStep:
    """A step's kernel arguments, plan and workspace on the device, shared by its layers."""

    args: VerifyArgs
    plan: LaunchPlan
    workspace: Workspace


def captured(fn) -> torch.cuda.CUDAGraph:
    """`fn()` captured in a CUDA graph, after one warm-up call on a side stream (lazy initialisation and the
    allocator's first requests stay out of the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class PlanGraph:
    """`plan_on_device` for one `PlanShape`, captured once as a CUDA graph, with the eager steps' buffers of that
    shape: its inputs, the marshal kernel's shape-sized outputs (`qo_indptr`, `combined_kv_indptr`, int32
    [bs + 1], `prefix_lens`, `tree_mask`), which it writes; `replay` refreshes the plan's arrays.
    Steps run in stream order, so one graph and its buffers serve every eager step of the shape: a step's
    `PreparedStep` holds until the next eager step of its shape is prepared. The plan graphs of a path share
    one memory pool: a graph's scratch may overlay another's arrays, which every replay recomputes before its
    step reads them."""

    def __init__(self, shape: PlanShape, mask_words: int, device, pool=None):
        bs = shape.batch_size
        self.qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        self.combined_kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        self.prefix_lens = torch.empty(bs, dtype=torch.int32, device=device)
        self.tree_mask = torch.empty(bs * shape.num_draft, mask_words, dtype=torch.int32, device=device)
        self.inputs = (self.qo_indptr, self.combined_kv_indptr, self.prefix_lens, self.tree_mask)
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            plan_on_device(*self.inputs, shape)  # warm-up
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.plan = plan_on_device(*self.inputs, shape)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)

    def replay(self) -> LaunchPlan:
        self.graph.replay()
        return self.plan


def serving_config(configs: tuple[KernelConfig, ...], body: str = "default") -> tuple[KernelConfig, str | None]:
    """The configuration a server runs for `body` (`kdtree.sglang.settings`, KDTREE_BODY) among the target's
    candidates, and why not, where it falls back to the first: `default` is the first (the target's own);
    `blocks64` its blocks64 configuration (Hopper)."""
    if body == "default":
        return configs[0], None
    if body == "blocks64":
        for c in configs:
            if c.blocks64:
                return c, None
        return configs[0], "no blocks64 configuration for this target: running its default"
    raise ValueError(f"body {body!r}: expected 'default' or 'blocks64'")


class ServingPath:
    """The marshal kernel, the device planner and the verify kernel, for one configuration (`config`, else
    `serving_config(kernel.configs, body)`; `fallback` says why `body` was not honoured, if it was not)."""

    def __init__(self, kernel: VerifyKernel | None = None, config: KernelConfig | None = None, body: str = "default"):
        import cupy

        self.kernel = kernel or VerifyKernel.get()
        self.fallback: str | None = None
        if config is None:
            config, self.fallback = serving_config(self.kernel.configs, body)
        self.config = config
        self.kernel.compiled(self.config)
        self.grid = self.kernel.num_sms * self.config.blocks_per_sm
        module = cupy.RawModule(code=MARSHAL_SOURCE.read_text(), options=("-std=c++17",))
        self._marshal = {
            torch.int64: module.get_function("verify_mla_marshal_i64"),
            torch.int32: module.get_function("verify_mla_marshal_i32"),
        }
        self._marshal_table = {
            torch.int32: module.get_function("verify_mla_marshal_table_i32"),
            torch.int64: module.get_function("verify_mla_marshal_table_i64"),
        }
        self.plan_graphs: OrderedDict[tuple, PlanGraph] = OrderedDict()
        self.use_plan_graphs = True
        self.plan_graph_error: str | None = None  # why plan graphs were turned off, if they were
        self._plan_pool = None  # one CUDA-graph memory pool for all plan graphs
        self._workspace: dict = {}  # eager steps' shared partials, by device
        self._combined: dict = {}  # eager steps' combined slot list, by device

    def _buffers(self, bs: int, n: int, num_heads: int, words: int, kv_capacity: int, dev) -> tuple:
        """(the shape's plan graph or None inside a capture, qo_indptr, combined_kv_indptr, combined slot list,
        prefix_lens, tree_mask): what the marshal kernel writes. Eager steps reuse their shape's buffers and one
        slot list per device (grown to powers of two); inside a capture they are the server graph's own."""
        if self.use_plan_graphs and not torch.cuda.is_current_stream_capturing():
            key = (bs, n, num_heads, words, dev)
            graph = self.plan_graphs.pop(key, None) or self._new_plan_graph(bs, n, num_heads, words, dev)
        else:
            graph = None
        if graph is not None:
            self.plan_graphs[key] = graph
            while len(self.plan_graphs) > PLAN_GRAPHS:
                self.plan_graphs.popitem(last=False)
            combined = self._combined.get(dev)
            if combined is None or combined.numel() < kv_capacity:
                combined = self._combined[dev] = torch.empty(1 << (kv_capacity - 1).bit_length(), dtype=torch.int32, device=dev)
            return graph, graph.qo_indptr, graph.combined_kv_indptr, combined, graph.prefix_lens, graph.tree_mask
        new = lambda *size: torch.empty(*size, dtype=torch.int32, device=dev)  # noqa: E731
        return None, new(bs + 1), new(bs + 1), new(kv_capacity), new(bs), new(bs * n, words)

    def _plan_shape(self, bs: int, n: int, num_heads: int) -> PlanShape:
        return PlanShape(bs, n, num_heads, self.config, self.grid, self.kernel.l2_bytes)

    def _new_plan_graph(self, bs: int, n: int, num_heads: int, words: int, dev) -> PlanGraph | None:
        """A plan graph for the shape, or None from now on if one cannot be captured here (the plan then runs op
        by op: slower on the host, the same bits)."""
        try:
            if self._plan_pool is None:
                self._plan_pool = torch.cuda.graph_pool_handle()
            return PlanGraph(self._plan_shape(bs, n, num_heads), words, dev, self._plan_pool)
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation
            self.use_plan_graphs = False
            self.plan_graph_error = f"{type(e).__name__}: {e}"
            return None

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
        bufs = self._buffers(bs, n, num_heads, words, kv_capacity, dev)
        graph, qo, combined_indptr, combined, prefix_lens, tree_mask = bufs
        qo.copy_(qo_indptr[: bs + 1])
        kvp = kv_indptr[: bs + 1].to(torch.int32)
        indices = kv_indices if kv_indices.dtype in self._marshal else kv_indices.to(torch.int64)
        mask = None if custom_mask is None else custom_mask.view(torch.uint8)
        mask_ptr = mask_indptr[: bs + 1].to(torch.int64)
        loc = out_cache_loc.to(torch.int64)  # converted copies live until the launch is enqueued
        self._launch_marshal(
            self._marshal[indices.dtype],
            bs,
            (qo, kvp, indices, loc, mask, mask_ptr, np.int32(words), combined_indptr, combined, prefix_lens, tree_mask),
        )
        return self._prepared(bufs, bs, n, num_heads, words, kv_capacity, dev)

    def prepare_table(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        custom_mask: torch.Tensor | None,
        *,
        batch_size: int,
        num_draft: int,
        num_heads: int,
        kv_capacity: int,
    ) -> PreparedStep:
        """Marshal and plan one step from SGLang's page table: request b's prefix slots are
        req_to_token[req_pool_indices[b], :seq_lens[b]] (TARGET_VERIFY's seq_lens: the prefix lengths), its N
        drafts' out_cache_loc follow; custom_mask has SGLang's layout (N rows of seq_lens + N a request).
        Device work only (graph-capturable); buffers may be longer than the batch."""
        dev, bs, n = seq_lens.device, batch_size, num_draft
        words = (n + 31) // 32
        bufs = self._buffers(bs, n, num_heads, words, kv_capacity, dev)
        graph, qo, combined_indptr, combined, prefix_lens, tree_mask = bufs
        table = req_to_token if req_to_token.dtype in self._marshal_table else req_to_token.to(torch.int32)
        mask = None if custom_mask is None else custom_mask.view(torch.uint8)
        # int64 copies held until the launch is enqueued: a temporary freed earlier is handed to the next
        rows, lens, loc = (t.to(torch.int64) for t in (req_pool_indices, seq_lens, out_cache_loc))
        mask_len = np.int64(0 if mask is None else mask.numel())
        self._launch_marshal(
            self._marshal_table[table.dtype],
            bs,
            (table, np.int64(table.stride(0)), rows, lens, loc, mask, mask_len, np.int32(n), np.int32(words))
            + (qo, combined_indptr, combined, prefix_lens, tree_mask),
        )
        return self._prepared(bufs, bs, n, num_heads, words, kv_capacity, dev)

    def _launch_marshal(self, fn, bs: int, args: tuple) -> None:
        """One marshal launch, (bs, MARSHAL_BLOCKS_Y) blocks on torch's stream; tensors (or None) go as device
        addresses, numpy scalars as they are, and the batch size last."""
        values = tuple(a if isinstance(a, np.generic) else device_ptr(a) for a in args) + (np.int32(bs),)
        with self.kernel.cupy_stream(torch.cuda.current_stream()):
            fn((bs, MARSHAL_BLOCKS_Y, 1), (MARSHAL_THREADS, 1, 1), values)

    def _prepared(self, bufs: tuple, bs: int, n: int, num_heads: int, words: int, kv_capacity: int, dev) -> PreparedStep:
        graph, qo, combined_indptr, combined, prefix_lens, tree_mask = bufs
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
        if graph is None:  # inside a capture: recorded into the server's graph, with a workspace of its own
            plan = plan_on_device(qo, combined_indptr, prefix_lens, tree_mask, self._plan_shape(bs, n, num_heads))
            return PreparedStep(args, plan, Workspace.for_plan(plan, dev))
        plan = graph.replay()
        workspace = self._workspace.get(dev)
        if workspace is None:
            workspace = self._workspace[dev] = Workspace.for_plan(plan, dev, row_tiles=1)
        return PreparedStep(args, plan, workspace)

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
