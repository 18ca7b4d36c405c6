"""The kdtree backend's state between SGLang's hooks (`StepState`) and the reasons it leaves a step or a layer
call to Triton (`Refusal`). SGLang-free, so both are checked on CPU; the backend is `kdtree.sglang.backend`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

HEAD_DIM, V_HEAD_DIM = 576, 512  # absorbed MLA: kv_lora_rank 512 + rope 64; V = the latent part


@enum.unique
class Refusal(enum.StrEnum):
    """Why a verify step or a layer call is Triton's: one message per reason, the text of its log line (logged
    once per message). Messages with {fields} are templates: fill them with `.format`."""

    MODE = "KDTREE_MODE={mode}"
    NOT_VERIFY = "not TARGET_VERIFY (prefill, decode and draft modes are Triton's)"
    NOT_MLA = "not an MLA model"
    DECODE_CONTEXT_PARALLEL = "decode context parallelism"
    DETERMINISTIC = "deterministic inference (Triton's unified kernel keeps its bits)"
    MHA_ONE_SHOT = "MHA one-shot prefill"
    SLIDING_WINDOW_POOL = "a sliding-window KV pool"
    DIFFUSION = "diffusion LLM attention"
    TOKEN_COUNT = "a verify batch whose token count is not batch x draft tokens"
    TRANSLATED_KV = "a translated KV read stream (SGLang's kv_index_translator maps the slots)"
    STEP_CHECK_FAILED = "the step check failed ({error})"
    NO_GRAPH_MASK = "no verify mask buffer"
    HEAD_DIMS = "head dims {qk}/{v}, not absorbed MLA " + f"{HEAD_DIM}/{V_HEAD_DIM}"
    NOT_BF16 = "q or the KV cache is not bf16 (fp8 KV cache)"
    SCALED_KV = "a scaled KV cache (k_scale / v_scale)"
    SLIDING_WINDOW_LAYER = "a sliding-window layer"
    SCORE_MODS = "sinks, score_mod or aux_tensors"
    NOT_CAUSAL_DECODER = "not causal decoder attention"
    XAI_TEMPERATURE = "xai temperature scaling"
    LOGIT_CAP_METHOD = "logit capping method {method!r}"
    GRAPH_READBACK = "CUDA-graph capture in {mode} mode (it reads results back; run it with --cuda-graph-backend-decode disabled)"


@dataclass
class StepState:
    """What the backend carries from one of SGLang's hooks to the next, by lifetime.

    The step in flight - set by `new_step`, at every forward-metadata hook:
      owned: kdtree serves this verify step from SGLang's page table; Triton's metadata is built only when a
        layer falls back to Triton.
      triton_ready: Triton's `forward_metadata` is this step's.
      batch: the step's metadata as kdtree reads it (`KdtreeAttnBackend.verify_batch`), built at first use;
        dropped by `forget_batch` at each new step, after a capture's warm-ups, and when preparing the step fails.
      batch_captured: whether `batch` was built inside a CUDA-graph capture (a capture builds its own).
      verify_step: the number of the TARGET_VERIFY step in flight, from 0 (-1 before the first); counts up in
        `new_step`, never reset. Shadow lines and capture files carry it.
      table: (req_to_token, row stride) that `step_refusal` found for the last step it accepted (or got as far
        as the page table in); read by the owned step that follows, replaced by the next check, never cleared.

    A CUDA-graph capture:
      graph_capture: (batch size, [kdtree served, Triton served]) from the hook that starts a capture until the
        next hook (`close_capture`), which files it in graph_sizes.

    The backend's life:
      graph_sizes: captured batch size -> whether every graph of that size ran kdtree alone (its replays then
        skip Triton's metadata hook).
      graph_kv_capacity: the combined slot list's bound in any replayed step, set when SGLang sizes its graphs
        (`init_cuda_graph_state`); None before.
    """

    owned: bool = False
    triton_ready: bool = False
    batch: Any = None  # VerifyBatch | TableBatch (kdtree.sglang.verify)
    batch_captured: bool = False
    verify_step: int = -1
    table: tuple[Any, int] | None = None
    graph_capture: tuple[int, list[bool]] | None = None
    graph_sizes: dict[int, bool] = field(default_factory=dict)
    graph_kv_capacity: int | None = None

    def forget_batch(self) -> None:
        self.batch, self.batch_captured = None, False

    def new_step(self, *, owned: bool, verify: bool) -> None:
        """A new step (or a new capture or replay of one): its batch is built again, Triton's metadata not yet."""
        self.forget_batch()
        self.owned, self.triton_ready = owned, False
        if verify:
            self.verify_step += 1

    def close_capture(self) -> None:
        """After a capture: its batch size replays without Triton's metadata if only kdtree ran in it."""
        if self.graph_capture is not None:
            bs, (kdtree_ran, triton_ran) = self.graph_capture
            # SGLang may hold several graphs of a size (variants): one that ran Triton rules the size out
            self.graph_sizes[bs] = self.graph_sizes.get(bs, True) and kdtree_ran and not triton_ran
            self.graph_capture = None

    @property
    def kdtree_graphs(self) -> set[int]:
        """The captured batch sizes whose replays need only kdtree's hook."""
        return {bs for bs, alone in self.graph_sizes.items() if alone}
