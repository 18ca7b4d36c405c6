"""`--attention-backend kdtree`: SGLang's Triton backend, with TARGET_VERIFY on absorbed MLA served, shadowed
or captured by kdtree (the mode: `kdtree.sglang.settings`).

Everything the kdtree kernel does not serve - other forward modes, other head dims, an fp8 or scaled KV
cache, sliding windows, sinks, score mods, decode context parallelism, deterministic mode; shadow and capture
modes under CUDA-graph capture (they read results back) - is Triton's, with one log line per reason. Serving
is CUDA-graph safe: the step is marshaled and planned on the GPU (`kdtree.serving`) from the metadata buffers
Triton's graph hooks refill at every replay. Any failure inside kdtree is logged once and that step falls back
to Triton: kdtree never takes a server down.

Imports SGLang (0.5.23): load it through the plugin (`kdtree.sglang.plugin`), not at kdtree's import time.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from kdtree.capture import CaptureMeta
from kdtree.sglang import log
from kdtree.sglang.capture_hook import CaptureWriter, capture_tensors
from kdtree.sglang.settings import Settings
from kdtree.sglang.shadow import shadow_diff
from kdtree.sglang.verify import VerifyBatch, VerifyRunner

HEAD_DIM, V_HEAD_DIM = 576, 512  # absorbed MLA: kv_lora_rank 512 + rope 64; V = the latent part


def _sglang_version() -> str | None:
    import sglang

    return getattr(sglang, "__version__", None)


class KdtreeAttnBackend(TritonAttnBackend):
    """Triton's backend; TARGET_VERIFY on absorbed MLA goes through kdtree as `KDTREE_MODE` says."""

    # layer calls whose output kdtree computed (served or shadowed), over all instances of this process
    kdtree_calls: int = 0

    def __init__(self, model_runner, *args, **kwargs):
        super().__init__(model_runner, *args, **kwargs)
        self.settings = Settings.from_env()
        self.runner = VerifyRunner()
        self.tp_rank = int(getattr(model_runner, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
        cfg = model_runner.model_config
        self.model_name = str(
            getattr(cfg, "model_path", None) or getattr(getattr(cfg, "hf_config", None), "architectures", ["unknown"])[0]
        )
        self.capture = CaptureWriter(self.settings.capture_dir, self.settings.capture_max_files, self.settings.capture_max_bytes)
        self.verify_step = -1
        self._batch: VerifyBatch | None = None
        self._batch_captured = False  # whether self._batch was built during a CUDA-graph capture
        self._graph_kv_capacity: int | None = None
        log.once(
            "mode", f"attention backend kdtree, mode {self.settings.mode} (KDTREE_MODE), TP rank {self.tp_rank}", logging.INFO
        )

    # ----- per step ---------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        # the combined slot list of any replayed step: at most max_bs prefixes of the context length, plus drafts
        self._graph_kv_capacity = max_bs * self.max_context_len + max_num_tokens

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._new_step(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self._new_step(forward_batch)

    def on_after_cuda_graph_warmup(self):
        super().on_after_cuda_graph_warmup()
        self._forget_step()  # the capture that follows marshals and plans inside the graph

    def _forget_step(self) -> None:
        self._batch = None
        self.runner.new_step()

    def _new_step(self, forward_batch) -> None:
        self._forget_step()
        if forward_batch.forward_mode.is_target_verify():
            self.verify_step += 1

    def verify_batch(self, forward_batch) -> VerifyBatch:
        """This step's metadata from Triton's `forward_metadata` (no host sync: CUDA-graph safe). Built once per
        step, and again when a CUDA-graph capture starts: SGLang runs a captured batch's forward eagerly first
        (warm-ups) without a new metadata call, and the graph must record the marshal kernel and the plan, sized
        for any replay, not reuse the warm-up's."""
        capturing = torch.cuda.is_current_stream_capturing()
        if self._batch is None or self._batch_captured != capturing:
            md = self.forward_metadata
            bs = len(forward_batch.req_pool_indices)
            n = int(md.max_extend_len)
            self._batch_captured = capturing
            if capturing or forward_batch.seq_lens_sum is None:
                capacity = self._graph_kv_capacity or (md.kv_indices.numel() + bs * n)
            else:
                capacity = int(forward_batch.seq_lens_sum) + bs * n
            self._batch = VerifyBatch(
                step=self.verify_step,
                qo_indptr=md.qo_indptr,
                kv_indptr=md.kv_indptr,
                kv_indices=md.kv_indices,
                out_cache_loc=forward_batch.out_cache_loc,
                custom_mask=md.custom_mask,
                mask_indptr=md.mask_indptr,
                batch_size=bs,
                num_draft=n,
                kv_capacity=capacity,
            )
        return self._batch

    # ----- what kdtree serves -----------------------------------------------------------------------
    def kdtree_refusal(self, q, layer, forward_batch, extra: dict) -> str | None:
        """Why this call is Triton's, or None when kdtree takes it."""
        if self.settings.mode == "triton":
            return "KDTREE_MODE=triton"
        if not forward_batch.forward_mode.is_target_verify():
            return "not TARGET_VERIFY (prefill, decode and draft modes are Triton's)"
        if not self.use_mla:
            return "not an MLA model"
        if layer.qk_head_dim != HEAD_DIM or layer.v_head_dim != V_HEAD_DIM:
            return f"head dims {layer.qk_head_dim}/{layer.v_head_dim}, not absorbed MLA {HEAD_DIM}/{V_HEAD_DIM}"
        if q.dtype != torch.bfloat16 or self.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype != torch.bfloat16:
            return "q or the KV cache is not bf16 (fp8 KV cache)"
        if layer.k_scale is not None or layer.v_scale is not None:
            return "a scaled KV cache (k_scale / v_scale)"
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            return "a sliding-window layer"
        if any(extra.get(name) is not None for name in ("sinks", "score_mod", "aux_tensors")):
            return "sinks, score_mod or aux_tensors"
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            return "not causal decoder attention"
        if getattr(layer, "xai_temperature_len", -1) > 0:
            return "xai temperature scaling"
        if layer.logit_cap and layer.logit_capping_method != "tanh":
            return f"logit capping method {layer.logit_capping_method!r}"
        if self.dcp_size > 1:
            return "decode context parallelism"
        if self.enable_deterministic:
            return "deterministic inference (Triton's unified kernel keeps its bits)"
        if getattr(forward_batch, "mha_one_shot", False):
            return "MHA one-shot prefill"
        if self.settings.mode != "serve" and torch.cuda.is_current_stream_capturing():
            return f"CUDA-graph capture in {self.settings.mode} mode (it reads results back; run it with --disable-cuda-graph)"
        if forward_batch.out_cache_loc.numel() != q.shape[0] or self.forward_metadata.qo_indptr is None:
            return "a verify batch whose token count is not batch x draft tokens"
        return None

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        refusal = self.kdtree_refusal(q, layer, forward_batch, kwargs)
        if refusal is not None:
            log.once(f"refuse:{refusal}", f"Triton serves: {refusal}", logging.INFO)
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        mode = self.settings.mode
        if mode == "serve":
            try:
                return self._serve(q, k, v, layer, forward_batch, save_kv_cache)
            except Exception as e:  # noqa: BLE001 - any kdtree failure falls back to Triton
                log.once(f"serve:{type(e).__name__}", f"kdtree failed ({type(e).__name__}: {e}); Triton serves")
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if self.settings.watches(self.verify_step, layer.layer_id, self.tp_rank):
            try:
                (self._shadow if mode == "shadow" else self._capture)(q, o, layer, forward_batch)
            except Exception as e:  # noqa: BLE001 - shadow and capture never break serving
                log.once(f"{mode}:{type(e).__name__}", f"{mode} failed ({type(e).__name__}: {e}); Triton's output is served")
        return o

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
            loc = KVWriteLoc.for_batch(forward_batch, swa_loc=self.forward_metadata.swa_out_cache_loc)
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
        print(d.line(self.settings.tolerance), flush=True)

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
        self.capture.write(f"step{batch.step:06d}-L{layer.layer_id}-tp{self.tp_rank}.safetensors", meta, tensors)
