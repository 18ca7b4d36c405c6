"""Test harness for running SGLang's attention stack where `sgl_kernel` cannot be installed.

`sgl_kernel` (sglang-kernel, 373 MB) does not fit a 64 MiB transfer to an offline GPU machine, and SGLang imports it without
a guard on CUDA. `install_sgl_kernel_shim()` provides, only when the real package is absent, the names SGLang's
import chain for the Triton attention backend, the MLA KV pool and the attention test kit asks of it:

- `sgl_kernel.utils.is_arch_support_pdl()`: the real one's answer, compute capability major >= 9 of the
  current device (True on the H200);
- the ops in `OPS` (activations, norms, quantized GEMMs, MoE, sampling, speculative-tree and KV-transfer ops,
  by module), which SGLang's modules import without a guard on CUDA but the attention path under test never
  calls: each is a function, as the real one is, that raises if called, so a test that reached one would fail
  rather than compute something else.

Every other name is missing, as in a build without it: another submodule raises ModuleNotFoundError and
another attribute AttributeError (ImportError for `from sgl_kernel import x`), so SGLang's own guarded imports
take the paths they take without sgl_kernel (e.g. its mock scalar types), and an unguarded one fails loudly.
Every name asked for is recorded in `REQUESTED` (`tools/sglang_imports.py` prints them).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch

OPS = {  # module: the ops SGLang's modules bind at import time (under `if _is_cuda:`, no try), never called here
    "sgl_kernel": frozenset(
        """
        apply_token_bitmask_inplace_cuda assign_draft_cache_locs_contiguous_cpu
        assign_extend_cache_locs_cpu assign_req_to_token_pool_cpu build_tree_kernel_efficient
        build_tree_kernel_efficient_cpu compress_norm_rope_store concat_mla_k
        copy_all_layer_kv_cache_cpu cutlass_w4a8_moe_mm es_fp8_blockwise_scaled_grouped_mm
        es_sm100_mxfp8_blockscaled_grouped_mm es_sm100_mxfp8_blockscaled_grouped_quant
        fill_accept_out_cache_loc_cpu fill_bonus_tokens_cpu flash_compress128_decode
        flash_compress128_prefill flash_compress4_decode flash_compress4_prefill
        fp8_blockwise_scaled_grouped_mm fp8_mqa_logits fp8_paged_mqa_logits fused_add_rmsnorm
        fused_inplace_qknorm_rope fused_k_norm_rope_flashmla fused_q_norm_rope gelu_and_mul
        gelu_quick gelu_tanh_and_mul gemma_fused_add_rmsnorm gemma_rmsnorm
        get_cutlass_w4a8_moe_mm_data int8_scaled_mm load_cache_to_device_buffer_dsv4_mla
        load_cache_to_device_buffer_mla merge_state_v2 min_p_sampling_from_probs moe_sum
        moe_sum_reduce plan_compress_decode plan_compress_decode_legacy plan_compress_prefill
        plan_compress_prefill_legacy rmsnorm rotate_input_ids_cpu sgl_per_tensor_quant_fp8
        sgl_per_token_quant_fp8 shuffle_rows silu_and_mul top_k_renorm_prob
        top_k_top_p_sampling_from_probs top_p_renorm_prob topk_sigmoid topk_softmax
        verify_tree_greedy_cpu weak_ref_tensor
        """.split()
    ),
    "sgl_kernel.flash_attn": frozenset(
        """
        flash_attn_varlen_func flash_attn_with_kvcache
        """.split()
    ),
    "sgl_kernel.kvcacheio": frozenset(
        """
        transfer_embedding_ranges_direct transfer_kv_all_layer transfer_kv_all_layer_direct_lf_pf
        transfer_kv_all_layer_lf_pf transfer_kv_all_layer_lf_ph transfer_kv_all_layer_mla
        transfer_kv_all_layer_mla_lf_pf transfer_kv_direct transfer_kv_per_layer
        transfer_kv_per_layer_direct_pf_lf transfer_kv_per_layer_mla transfer_kv_per_layer_mla_pf_lf
        transfer_kv_per_layer_pf_lf transfer_kv_per_layer_ph_lf
        """.split()
    ),
    "sgl_kernel.mamba": frozenset(
        """
        causal_conv1d_fn_cpu causal_conv1d_update_cpu chunk_gated_delta_rule_cpu
        """.split()
    ),
    "sgl_kernel.quantization": frozenset(
        """
        ggml_dequantize ggml_moe_a8 ggml_moe_a8_vec ggml_mul_mat_a8 ggml_mul_mat_vec_a8
        """.split()
    ),
    "sgl_kernel.speculative": frozenset(
        """
        reconstruct_indices_from_tree_mask
        """.split()
    ),
}
MODULES = ("sgl_kernel", "sgl_kernel.utils", *OPS)
REQUESTED: list[str] = []


@functools.cache
def is_arch_support_pdl() -> bool:
    major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
    return major >= 9


ANSWERS = {"sgl_kernel.utils.is_arch_support_pdl": is_arch_support_pdl}


def _uncallable_op(fullname: str):
    def op(*args, **kwargs):
        raise RuntimeError(f"{fullname}: a sgl_kernel op kdtree's test shim does not provide")

    op.__name__ = op.__qualname__ = fullname.rsplit(".", 1)[-1]
    return op


class _ShimModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        fullname = f"{self.__name__}.{name}"
        REQUESTED.append(fullname)
        if fullname in ANSWERS:
            return ANSWERS[fullname]
        if name in OPS.get(self.__name__, ()):
            return _uncallable_op(fullname)
        raise AttributeError(f"module {self.__name__!r} (kdtree's test shim) has no attribute {name!r}")


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            REQUESTED.append(fullname)
            if fullname in MODULES:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            raise ModuleNotFoundError(f"No module named {fullname!r} (kdtree's sgl_kernel test shim)", name=fullname)
        return None

    def create_module(self, spec):
        module = _ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_sgl_kernel_shim() -> bool:
    """Provide the shim when the real sgl_kernel is not installed; True when the shim is in place."""
    if any(isinstance(f, _ShimFinder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    sys.meta_path.insert(0, _ShimFinder())
    return True
