"""`--attention-backend kdtree`: SGLang's Triton backend, with TARGET_VERIFY on absorbed MLA served, shadowed
or captured by kdtree (the mode: `kdtree.sglang.settings`).

Everything the kdtree kernel does not serve - other forward modes, other head dims, an fp8 or scaled KV
cache, sliding windows, sinks, score mods, decode context parallelism, deterministic mode; shadow and capture
modes under CUDA-graph capture (they read results back) - is Triton's, with one log line per reason.

A TARGET_VERIFY step kdtree serves builds no Triton metadata: the step is marshaled and planned on the GPU
(`kdtree.serving`) straight from SGLang's page table, lengths and mask (`TableBatch`), so its host work is a
few launches eager and one mask copy before a graph replay. Triton's metadata is built when Triton is needed:
eagerly on a step's first Triton call; always at a CUDA-graph capture, and before the replays of a graph in
which some layer ran Triton's kernel. Any failure inside kdtree is logged once and that call falls back to
Triton: kdtree never takes a server down. What the backend carries between SGLang's hooks is one `StepState`,
and each reason it leaves a step or a call to Triton one `Refusal` (`kdtree.sglang.step`).

Imports SGLang (0.5.23): load it through the plugin (`kdtree.sglang.plugin`), not at kdtree's import time.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from kdtree.capture import CaptureMeta
from kdtree.sglang import log
from kdtree.sglang.capture_hook import CaptureWriter, capture_tensors
from kdtree.sglang.settings import Settings, SettingsError
from kdtree.sglang.shadow import shadow_diff
from kdtree.sglang.step import HEAD_DIM, V_HEAD_DIM, Refusal, StepState
from kdtree.sglang.verify import TableBatch, VerifyBatch, VerifyRunner


def _sglang_version() -> str | None:
    import sglang

    return getattr(sglang, "__version__", None)


class KdtreeAttnBackend(TritonAttnBackend):
    """Triton's backend; TARGET_VERIFY on absorbed MLA goes through kdtree as `KDTREE_MODE` says."""

    # layer calls whose output kdtree computed (served or shadowed), over all instances of this process
    kdtree_calls: int = 0

    def __init__(self, model_runner, *args, **kwargs):
        super().__init__(model_runner, *args, **kwargs)
        try:
            self.settings = Settings.from_env()
        except SettingsError as e:  # a server that starts, serving Triton's attention, beats one that does not
            self.settings = Settings(mode="triton")
            log.once("settings", f"{e}; kdtree is off: Triton serves every step (set the variable right and restart)")
        self.runner = VerifyRunner(body=self.settings.body)
        self.tp_rank = int(getattr(model_runner, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
        cfg = model_runner.model_config
        self.model_name = str(
            getattr(cfg, "model_path", None) or getattr(getattr(cfg, "hf_config", None), "architectures", ["unknown"])[0]
        )
        self.capture = CaptureWriter(self.settings.capture_dir, self.settings.capture_max_files, self.settings.capture_max_bytes)
        self.step_state = StepState()  # the step in flight and the CUDA graphs captured (`StepState`)
        if self.settings.mode == "serve":
            self._selfcheck()
        log.once(
            "mode",
            f"attention backend kdtree, mode {self.settings.mode} (KDTREE_MODE), body {self.settings.body} (KDTREE_BODY), "
            f"TP rank {self.tp_rank}",
            logging.INFO,
        )

    def _selfcheck(self) -> None:
        """Before the first served step, never inside one: the kernel's self-check on this GPU (`kdtree.selfcheck`,
        cached per GPU, driver and kernel source). A failed check, or one that cannot run, makes this server's
        verify steps Triton's, said in one line; KDTREE_SELFCHECK=0 skips it."""
        from kdtree import selfcheck

        try:
            outcome = selfcheck.ensure("cuda")
            verdict, notes = outcome.verdict, "".join(f"; {n}" for n in outcome.notes)
            if verdict is None:
                log.once("selfcheck", f"self-check skipped ({selfcheck.SKIP_VAR}=0)", logging.INFO)
            elif not verdict.passed:
                worst = next(r for r in verdict.rows if not r.passed)
                log.once(
                    "selfcheck",
                    f"kdtree's self-check FAILED on {verdict.key.gpu} ({worst.name}: rel {worst.worst_rel:.2e} > "
                    f"{verdict.tolerance:g}){notes}; Triton serves (`kdtree selfcheck --force` checks again)",
                )
                self.settings = dataclasses.replace(self.settings, mode="triton")
            else:
                how = "cached" if outcome.cached else f"{len(verdict.rows)} batches in {verdict.seconds:.1f} s"
                level = logging.WARNING if notes else logging.INFO
                log.once("selfcheck", f"self-check passed on {verdict.key.gpu} ({how}){notes}", level)
        except Exception as e:  # noqa: BLE001 - kdtree never takes a server down
            log.once(
                "selfcheck", f"kdtree could not prepare: its self-check did not run ({type(e).__name__}: {e}); Triton serves"
            )
            self.settings = dataclasses.replace(self.settings, mode="triton")

    @property
    def verify_step(self) -> int:
        """The number of the TARGET_VERIFY step in flight (`StepState.verify_step`)."""
        return self.step_state.verify_step

    @property
    def _triton_ready(self) -> bool:
        return self.step_state.triton_ready

    @property
    def _kdtree_graphs(self) -> set[int]:
        """The captured batch sizes whose replays need only kdtree's hook."""
        return self.step_state.kdtree_graphs

    # ----- per step ---------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        # the combined slot list of any replayed step: at most max_bs prefixes of the context length, plus drafts
        self.step_state.graph_kv_capacity = max_bs * self.max_context_len + max_num_tokens

    def init_forward_metadata(self, forward_batch):
        self._close_capture()
        self._new_step(forward_batch, owned=self._owns(forward_batch))
        if self.step_state.owned:
            self._prepare_step(forward_batch)  # reads SGLang's page table where Triton's metadata would
        if not self.step_state.owned:
            super().init_forward_metadata(forward_batch)
            self.step_state.triton_ready = True

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self._close_capture()
        bs = len(forward_batch.req_pool_indices)
        is_verify = forward_batch.forward_mode.is_target_verify()
        if not in_capture:  # a replay: its graph is fixed, whatever this step would choose
            if is_verify and self.step_state.graph_sizes.get(bs, False):
                self._refill_graph_mask(forward_batch)  # all the host work a replayed kdtree step has
                log.once("replay", f"serving: replaying CUDA graphs kdtree captured (batch size {bs} first)", logging.INFO)
                self._new_step(forward_batch, owned=True)
                return
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            self._new_step(forward_batch, owned=False)
            self.step_state.triton_ready = True
            return
        owned = self._owns(forward_batch)
        spec = forward_batch.spec_info
        if owned and spec is not None and spec.custom_mask is not None and self._graph_mask() is None:
            owned = False  # no mask buffer for the replays to refill (Triton's hook would fail the same way)
            log.once("graph:mask", f"Triton's metadata for graph-captured verify steps: {Refusal.NO_GRAPH_MASK}", logging.INFO)
        if is_verify and not owned:
            self.step_state.graph_sizes[bs] = False
        self.step_state.graph_capture = (bs, [False, False]) if owned else None
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self._new_step(forward_batch, owned=owned)
        self.step_state.triton_ready = True  # a capture records Triton's buffers for a layer that falls back

    def init_forward_metadata_in_graph(self, forward_batch):
        """Inside the capture (and its warm-ups), before SGLang's shared-read event: the marshal kernel reads
        `req_to_token` here, as Triton's hook does before a replay, not at the first layer."""
        super().init_forward_metadata_in_graph(forward_batch)
        if self.step_state.owned and forward_batch.forward_mode.is_target_verify():
            self._prepare_step(forward_batch)

    def _prepare_step(self, forward_batch) -> None:
        """Marshal and plan this owned step now; a failure makes it Triton's (logged once)."""
        try:
            self.runner.prepare(self.verify_batch(forward_batch), self.num_head)
        except Exception as e:  # noqa: BLE001 - kdtree never breaks a step
            log.once(
                f"prepare:{type(e).__name__}", f"kdtree could not prepare a verify step ({type(e).__name__}: {e}); Triton serves"
            )
            self.step_state.owned = False
            self._forget_step()
            self._note_capture(kdtree=False)

    def on_after_cuda_graph_warmup(self):
        super().on_after_cuda_graph_warmup()
        self._forget_step()  # the capture that follows marshals and plans inside the graph

    def _close_capture(self) -> None:
        self.step_state.close_capture()

    def _note_capture(self, kdtree: bool) -> None:
        """Record who served a layer of the graph being captured."""
        capture = self.step_state.graph_capture
        if capture is not None and torch.cuda.is_current_stream_capturing():
            capture[1][0 if kdtree else 1] = True

    def _refill_graph_mask(self, forward_batch) -> None:
        spec = forward_batch.spec_info
        buf = self._graph_mask()
        if buf is not None and spec is not None and spec.custom_mask is not None:
            n = spec.custom_mask.shape[0]
            if buf.data_ptr() != spec.custom_mask.data_ptr():
                buf[:n].copy_(spec.custom_mask, non_blocking=True)

    def _graph_mask(self) -> torch.Tensor | None:
        mask = getattr(self, "_verify_mask", None)
        return None if mask is None else mask.buffer

    def _forget_step(self) -> None:
        self.step_state.forget_batch()
        self.runner.new_step()

    def _new_step(self, forward_batch, *, owned: bool) -> None:
        self.runner.new_step()
        self.step_state.new_step(owned=owned, verify=forward_batch.forward_mode.is_target_verify())

    def ensure_triton_metadata(self, forward_batch) -> None:
        """Triton's forward_metadata for this step, built now if this step (kdtree's) had none: before a Triton
        call, and for tests and benchmarks that run Triton's kernel on the same step."""
        if not self.step_state.triton_ready:
            super().init_forward_metadata(forward_batch)
            self.step_state.triton_ready = True

    def num_tokens_per_request(self, forward_batch) -> int:
        """N: the draft tokens a request verifies this step (SGLang's `num_tokens_per_req`)."""
        spec = forward_batch.spec_info
        n = getattr(spec, "num_tokens_per_req", -1) if spec is not None else -1
        return (
            int(n) if n is not None and n > 0 else int(getattr(self, "target_verify_num_tokens_per_req", self.num_draft_tokens))
        )

    def page_table(self, forward_batch):
        """(req_to_token, its row stride) when request b's prefix slots are req_to_token[req_pool_indices[b],
        :seq_lens[b]] (SGLang's untranslated read stream), else None."""
        translator = getattr(self, "kv_index_translator", None)
        if translator is None:
            return self.req_to_token, self.req_to_token.stride(0)
        bs = len(forward_batch.req_pool_indices)
        src = translator.read_source(forward_batch.kv_loc_plan, req_pool_indices=forward_batch.req_pool_indices, bs=bs)
        if src.is_translated or getattr(src, "v2p", None) is not None or src.entry_page_size != 1:
            return None
        return src.ids, src.row_stride

    def verify_batch(self, forward_batch) -> VerifyBatch | TableBatch:
        """This step's metadata (no host sync: CUDA-graph safe), from SGLang's page table in a step kdtree owns,
        else from Triton's `forward_metadata`. Built once per step, and again when a CUDA-graph capture starts:
        SGLang runs a captured batch's forward eagerly first (warm-ups) without a new metadata call, and the
        graph must record the marshal kernel and the plan, sized for any replay, not reuse the warm-up's."""
        capturing = torch.cuda.is_current_stream_capturing()
        state = self.step_state
        if state.batch is None or state.batch_captured != capturing:
            state.batch_captured = capturing
            state.batch = (
                self._table_batch(forward_batch, capturing) if state.owned else self._csr_batch(forward_batch, capturing)
            )
        return state.batch

    def _capacity(self, forward_batch, capturing: bool, tokens: int) -> int | None:
        """The combined slot list's length bound: the graph's inside a capture, else the step's (None where
        SGLang has no host sum: the caller bounds it by the context length, as Triton does)."""
        if capturing:
            return self.step_state.graph_kv_capacity
        if forward_batch.seq_lens_sum is None:
            return None
        return int(forward_batch.seq_lens_sum) + tokens

    def _table_batch(self, forward_batch, capturing: bool) -> TableBatch:
        bs = len(forward_batch.req_pool_indices)
        n = self.num_tokens_per_request(forward_batch)
        table, _ = self.step_state.table or self.page_table(forward_batch)  # step_refusal's, for this step
        spec = forward_batch.spec_info
        mask = None if spec is None or spec.custom_mask is None else spec.custom_mask
        if capturing and mask is not None:
            mask = self._graph_mask()  # the buffer the replays refill (`_refill_graph_mask`)
        capacity = self._capacity(forward_batch, capturing, bs * n) or bs * (self.max_context_len + n)
        return TableBatch(
            step=self.step_state.verify_step,
            req_to_token=table,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens,
            out_cache_loc=forward_batch.out_cache_loc,
            custom_mask=mask,
            batch_size=bs,
            num_draft=n,
            kv_capacity=capacity,
        )

    def _csr_batch(self, forward_batch, capturing: bool) -> VerifyBatch:
        self.ensure_triton_metadata(forward_batch)
        md = self.forward_metadata
        bs = len(forward_batch.req_pool_indices)
        n = int(md.max_extend_len)
        return VerifyBatch(
            step=self.step_state.verify_step,
            qo_indptr=md.qo_indptr,
            kv_indptr=md.kv_indptr,
            kv_indices=md.kv_indices,
            out_cache_loc=forward_batch.out_cache_loc,
            custom_mask=md.custom_mask,
            mask_indptr=md.mask_indptr,
            batch_size=bs,
            num_draft=n,
            kv_capacity=self._capacity(forward_batch, capturing, bs * n) or (md.kv_indices.numel() + bs * n),
        )

    # ----- what kdtree serves -----------------------------------------------------------------------
    def step_refusal(self, forward_batch) -> str | None:
        """Why this step is not kdtree's to serve (None: it is; Triton's metadata then waits until needed)."""
        if self.settings.mode != "serve":
            return Refusal.MODE.format(mode=self.settings.mode)
        reason = self._batch_refusal(forward_batch)
        if reason is not None:
            return reason
        if getattr(self, "use_sliding_window_kv_pool", False):
            return Refusal.SLIDING_WINDOW_POOL
        if getattr(self, "dllm_attention", None) is not None:
            return Refusal.DIFFUSION
        bs = len(forward_batch.req_pool_indices)
        if forward_batch.out_cache_loc is None or forward_batch.out_cache_loc.numel() != bs * self.num_tokens_per_request(
            forward_batch
        ):
            return Refusal.TOKEN_COUNT
        self.step_state.table = self.page_table(forward_batch)
        if self.step_state.table is None:
            return Refusal.TRANSLATED_KV
        return None

    def _owns(self, forward_batch) -> bool:
        """Whether kdtree serves this step from its own metadata (a failing check is a refusal, logged once)."""
        try:
            reason = self.step_refusal(forward_batch)
        except Exception as e:  # noqa: BLE001 - the check never breaks a step
            reason = Refusal.STEP_CHECK_FAILED.format(error=f"{type(e).__name__}: {e}")
        if reason is not None and self.settings.mode == "serve" and forward_batch.forward_mode.is_target_verify():
            log.once(f"step:{reason}", f"Triton's metadata for verify steps: {reason}", logging.INFO)
        return reason is None

    def _batch_refusal(self, forward_batch) -> str | None:
        """What rules a batch out whatever its layers: the mode, the model, the server's settings."""
        if not forward_batch.forward_mode.is_target_verify():
            return Refusal.NOT_VERIFY
        if not self.use_mla:
            return Refusal.NOT_MLA
        if self.dcp_size > 1:
            return Refusal.DECODE_CONTEXT_PARALLEL
        if self.enable_deterministic:
            return Refusal.DETERMINISTIC
        if getattr(forward_batch, "mha_one_shot", False):
            return Refusal.MHA_ONE_SHOT
        return None

    def kdtree_refusal(self, q, layer, forward_batch, extra: dict) -> str | None:
        """Why this call is Triton's, or None when kdtree takes it."""
        if self.settings.mode == "triton":
            return Refusal.MODE.format(mode="triton")
        reason = self._batch_refusal(forward_batch)
        if reason is not None:
            return reason
        if layer.qk_head_dim != HEAD_DIM or layer.v_head_dim != V_HEAD_DIM:
            return Refusal.HEAD_DIMS.format(qk=layer.qk_head_dim, v=layer.v_head_dim)
        if q.dtype != torch.bfloat16 or self.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype != torch.bfloat16:
            return Refusal.NOT_BF16
        if layer.k_scale is not None or layer.v_scale is not None:
            return Refusal.SCALED_KV
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            return Refusal.SLIDING_WINDOW_LAYER
        if any(extra.get(name) is not None for name in ("sinks", "score_mod", "aux_tensors")):
            return Refusal.SCORE_MODS
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            return Refusal.NOT_CAUSAL_DECODER
        if getattr(layer, "xai_temperature_len", -1) > 0:
            return Refusal.XAI_TEMPERATURE
        if layer.logit_cap and layer.logit_capping_method != "tanh":
            return Refusal.LOGIT_CAP_METHOD.format(method=layer.logit_capping_method)
        if self.settings.mode != "serve" and torch.cuda.is_current_stream_capturing():
            return Refusal.GRAPH_READBACK.format(mode=self.settings.mode)
        # the token count: the step's out_cache_loc, and (a step kdtree does not own) Triton's metadata for it
        if forward_batch.out_cache_loc.numel() != q.shape[0] or (
            not self.step_state.owned and self.forward_metadata.qo_indptr is None
        ):
            return Refusal.TOKEN_COUNT
        return None

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        refusal = self.kdtree_refusal(q, layer, forward_batch, kwargs)
        if refusal is not None:
            log.once(f"refuse:{refusal}", f"Triton serves: {refusal}", logging.INFO)
            return self._triton(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        mode = self.settings.mode
        if mode == "serve":
            try:
                o = self._serve(q, k, v, layer, forward_batch, save_kv_cache)
                self._note_capture(kdtree=True)
                if not log.said("served") and not torch.cuda.is_current_stream_capturing():  # a step run, not recorded
                    log.once(
                        "served",
                        f"serving: first verify step kdtree served (batch {len(forward_batch.req_pool_indices)}, "
                        f"{self.num_tokens_per_request(forward_batch)} draft tokens, {layer.tp_q_head_num} heads)",
                        logging.INFO,
                    )
                return o
            except Exception as e:  # noqa: BLE001 - any kdtree failure falls back to Triton
                log.once(f"serve:{type(e).__name__}", f"kdtree failed ({type(e).__name__}: {e}); Triton serves")
                return self._triton(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if self.settings.watches(self.step_state.verify_step, layer.layer_id, self.tp_rank):
            try:
                (self._shadow if mode == "shadow" else self._capture)(q, o, layer, forward_batch)
            except Exception as e:  # noqa: BLE001 - shadow and capture never break serving
                log.once(f"{mode}:{type(e).__name__}", f"{mode} failed ({type(e).__name__}: {e}); Triton's output is served")
        return o

    def _triton(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs):
        """Triton's call, its metadata built first where this step had none."""
        if forward_batch.forward_mode.is_target_verify():
            self.ensure_triton_metadata(forward_batch)
            self._note_capture(kdtree=False)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _kdtree(self, q, layer, forward_batch, out=None) -> torch.Tensor:
        """kdtree's output [T, H, 512] for this layer (into `out` when given)."""
        H = layer.tp_q_head_num
        q3 = q.view(-1, H, HEAD_DIM)
        o = out if out is not None else q.new_empty(q3.shape[0], H, V_HEAD_DIM)
        self.runner.run(
            self.verify_batch(forward_batch),
            q3,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            o.view(-1, H, V_HEAD_DIM),
            sm_scale=layer.scaling,
            logit_cap=float(layer.logit_cap or 0.0),
        )
        KdtreeAttnBackend.kdtree_calls += 1
        return o

    def _serve(self, q, k, v, layer, forward_batch, save_kv_cache):
        if k is not None and save_kv_cache:  # SGLang's order: the drafts' keys go into the pool first
            swa = None if self.step_state.owned else self.forward_metadata.swa_out_cache_loc  # an owned step has no SWA pool
            loc = KVWriteLoc.for_batch(forward_batch, swa_loc=swa)
            self._set_kv_buffer(forward_batch, layer, loc, k, v)
        out = getattr(forward_batch, "_attn_output", None)
        if out is None:
            out = q.new_empty((q.shape[0], layer.tp_q_head_num * V_HEAD_DIM))
        return self._kdtree(q, layer, forward_batch, out)

    def _shadow(self, q, o, layer, forward_batch) -> None:
        H = layer.tp_q_head_num
        mine = self._kdtree(q, layer, forward_batch)
        batch = self.verify_batch(forward_batch)
        qo = batch.qo_indptr[: batch.batch_size + 1].cpu()
        d = shadow_diff(mine, o.view(-1, H, V_HEAD_DIM), qo, layer=layer.layer_id, step=batch.step)
        print(d.line(self.settings.tolerance, self.tp_rank if self.tp_size > 1 else None), flush=True)

    def _capture(self, q, o, layer, forward_batch) -> None:
        if not self.capture.enabled:
            return
        batch = self.verify_batch(forward_batch)
        H = layer.tp_q_head_num
        pool = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        spec = forward_batch.spec_info
        meta = CaptureMeta(
            num_heads=H,
            sm_scale=float(layer.scaling),
            layer_ids=[layer.layer_id],
            pool_size=pool.shape[0] - self.page_size,
            page_size=self.page_size,
            logit_cap=float(layer.logit_cap or 0.0),
            kv_lora_rank=V_HEAD_DIM,
            qk_rope_head_dim=HEAD_DIM - V_HEAD_DIM,
            model=self.model_name,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            spec_algorithm=type(spec).__name__.removesuffix("VerifyInput").upper() if spec is not None else "unknown",
            num_draft_tokens=batch.num_draft,
            source={"kind": "sglang", "step": batch.step, "writer": "kdtree backend, KDTREE_MODE=capture"},
            reference="sglang:triton extend_attention_fwd",
            sglang_version=_sglang_version(),
        )
        tensors = capture_tensors(batch, layer.layer_id, q.view(-1, H, HEAD_DIM), o.view(-1, H, V_HEAD_DIM), pool)
        self.capture.write(f"step{batch.step:06d}-L{layer.layer_id}-tp{self.tp_rank}", meta, tensors)
