"""SGLang's Triton `extend_attention_fwd`, called exactly as its Triton backend does in TARGET_VERIFY
(causal, custom mask, prefix columns skipped, draft keys from k/v, prefix keys from the pool).

SGLang is optional: `extend_attention()` returns None and the reason when it does not import. Its location
and signature move between releases, so both are looked up, never assumed.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from kdtree.capture import Capture

MODULES = ("sglang.kernels.ops.attention.extend_attention", "sglang.srt.layers.attention.triton_ops.extend_attention")


def extend_attention() -> tuple[Callable | None, str]:
    """(extend_attention_fwd, where it came from) or (None, why not)."""
    errors = []
    for mod in MODULES:
        try:
            m = __import__(mod, fromlist=["extend_attention_fwd"])
            import sglang

            return m.extend_attention_fwd, f"{mod} (sglang {getattr(sglang, '__version__', '?')})"
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            errors.append(f"{mod}: {type(e).__name__}: {e}")
    return None, "; ".join(errors)


def verify_call(cap: Capture, layer_id: int, fn: Callable, device="cuda"):
    """(call(q, kv_buffer), o): `call` runs SGLang's kernel on one layer's q [T, H, 576] and pool
    [slots, 1, 576]; everything else is bound once here."""
    T, H = cap.num_tokens, cap.meta.num_heads
    k = cap.layer(layer_id).k.to(device)
    o = torch.empty(T, H, cap.meta.v_head_dim, dtype=torch.bfloat16, device=device)
    kw = {
        "k_extend": k,
        "v_extend": k[..., : cap.meta.v_head_dim].contiguous(),
        "o_extend": o,
        "qo_indptr": cap.qo_indptr.to(device, torch.int32),
        "kv_indptr": cap.kv_indptr.to(device, torch.int32),
        "kv_indices": cap.kv_indices.to(device, torch.int64),
        "custom_mask": cap.custom_mask.to(device),
        "is_causal": True,
        "mask_indptr": cap.mask_indptr.to(device, torch.int64),
        "max_len_extend": int(cap.num_draft.max()),
        "k_scale": 1.0,
        "v_scale": 1.0,
        "sm_scale": float(cap.meta.sm_scale),
        "logit_cap": float(cap.meta.logit_cap),
        "skip_prefix_custom_mask": True,
    }
    params = inspect.signature(fn).parameters
    positional = ("q_extend", "k_buffer", "v_buffer")
    missing = [p for p, s in params.items() if s.default is inspect.Parameter.empty and p not in kw and p not in positional]
    if missing:
        raise RuntimeError(f"this SGLang's extend_attention_fwd wants arguments kdtree does not know: {missing}")
    kw = {name: value for name, value in kw.items() if name in params}
    dv = cap.meta.v_head_dim

    def call(q: torch.Tensor, kv_buffer: torch.Tensor) -> None:
        fn(q_extend=q, k_buffer=kv_buffer, v_buffer=kv_buffer[..., :dv], **kw)

    return call, o


def run(cap: Capture, layer_id: int, device="cuda") -> torch.Tensor:
    """o [T, H, 512] bf16 from SGLang's Triton kernel for one layer (raises if SGLang is not importable)."""
    fn, why = extend_attention()
    if fn is None:
        raise ValueError(f"SGLang's Triton kernel is not importable here: {why}")
    call, o = verify_call(cap, layer_id, fn, device)
    call(cap.layer(layer_id).q.to(device), cap.pool(layer_id, device))
    return o
