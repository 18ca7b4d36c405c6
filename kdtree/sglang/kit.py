"""SGLang's own server-free attention test kit (`sglang.test.kits.attention_unittest`, in SGLang's wheel) run
with kdtree's trees: a real `ForwardBatch`, `ReqToTokenPool`, `MLATokenToKVPool` and `EagleVerifyInput`, the
kit's tiny DeepSeek-style MLA module on the absorbed path and its reference module, and any backend by name.

The kit's own tree cases are limited (topk > 1 only with 3 draft tokens); `run_verify` takes any trees
(`kdtree.trees`) through the kit's building blocks. Used by the GPU tests and `tools/sglang_captures.py`.
Imports SGLang and its kit (GPU, SGLang importable).
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
    MLAAttentionCase,
    build_mla_attention_fixture,
    mla_attention_reference_with_custom_mask,
    mla_fixture_inputs,
    run_mla_forward,
)
from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
    _make_spec_verify_input,
    _prepare_target_verify_batch,
)

from kdtree.trees import ancestor_mask

# absorbed MLA as Kimi K2 / DeepSeek-V3 run it (the kit's defaults are kv_lora_rank 32, rope 0, fp16)
MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)


class KitTestCase(unittest.TestCase):
    """The `testcase` the kit's helpers take; a skip the kit asks for (a backend that does not build) fails."""

    def runTest(self):  # pragma: no cover - never run as a test itself
        pass

    def skipTest(self, reason):
        raise AssertionError(f"SGLang's kit would skip: {reason}")


def verify_case(name: str, backend: str, prefix_lens, num_draft: int, num_heads: int, page_size: int = 1) -> MLAAttentionCase:
    return MLAAttentionCase(
        name=name,
        backend=backend,
        forward_mode=ForwardMode.TARGET_VERIFY,
        num_heads=num_heads,
        page_size=page_size,
        prefix_lens=tuple(prefix_lens),
        extend_lens=(num_draft,) * len(prefix_lens),
    )


def masks_for(parents_by_req, prefix_lens, device="cuda") -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per request [N, prefix_len + N] (prefix visible, drafts by ancestry), and SGLang's flat custom_mask."""
    masks = []
    for parents, p in zip(parents_by_req, prefix_lens):
        tree = torch.from_numpy(ancestor_mask(np.asarray(parents)))
        m = torch.ones(tree.shape[0], p + tree.shape[0], dtype=torch.bool)
        m[:, p:] = tree
        masks.append(m.to(device))
    return masks, torch.cat([m.flatten() for m in masks])


@dataclass
class KitRun:
    fixture: object
    actual: torch.Tensor  # the kit module's output (after W_vc and o_proj) with the backend under test
    expected: torch.Tensor  # the kit's reference module on the same hidden states and masks
    attn: dict  # attention outputs [T, H * 512] of the layer's forward_extend: "backend", and "triton" if asked


def verify_fixture(
    case: MLAAttentionCase, parents_by_req, *, scaling: float | None = None, max_context_len: int | None = None, **fixture_kw
):
    """(the kit's MLA fixture for `case` at 512/64/bf16, its ForwardBatch prepared for target verify with an
    EagleVerifyInput over the given trees, the per-request masks). `scaling` overrides the layer's softmax scale
    (the kit's is 576**-0.5; Kimi K2's is 0.130861); `fixture_kw` go to the kit's fixture builder."""
    ctx = max_context_len or (max(case.seq_lens) + 8)
    fixture = build_mla_attention_fixture(KitTestCase(), case, max_context_len=ctx, **MLA_DIMS, **fixture_kw)
    if scaling is not None:
        fixture.actual_module.attn_mqa.scaling = scaling
        fixture.reference_module.scaling = scaling
    batch = fixture.forward_batch
    _prepare_target_verify_batch(batch, case, "cuda")
    spec = _make_spec_verify_input(case, batch, topk=1, device="cuda", spec_kind="eagle")
    masks, spec.custom_mask = masks_for(parents_by_req, case.prefix_lens)
    batch.spec_info = spec
    return fixture, masks


def run_verify(
    case: MLAAttentionCase,
    parents_by_req,
    *,
    scaling: float | None = None,
    with_triton: bool = False,
    max_context_len: int | None = None,
    steps: int = 1,
) -> KitRun:
    """One target-verify forward of the kit's MLA module with `case.backend`, over the given trees
    (`verify_fixture`). `with_triton` also runs SGLang's Triton `forward_extend` on the same call's inputs and
    metadata; `steps` repeats the forward (a new verify step each time: metadata rebuilt, same tensors)."""
    fixture, masks = verify_fixture(case, parents_by_req, scaling=scaling, max_context_len=max_context_len)
    batch = fixture.forward_batch
    inputs = mla_fixture_inputs(fixture)
    expected = mla_attention_reference_with_custom_mask(
        fixture.reference_module, case, inputs["prefix_hidden"], inputs["input_hidden"], masks
    )
    backend, attn = fixture.backend, {}
    own = backend.forward_extend

    def recorded(q, k, v, layer, fb, save_kv_cache=True, **kw):
        o = own(q, k, v, layer, fb, save_kv_cache, **kw)
        attn["backend"] = o.clone()
        if with_triton:
            getattr(backend, "ensure_triton_metadata", lambda fb: None)(fb)  # kdtree's step may have none
            attn["triton"] = TritonAttnBackend.forward_extend(backend, q, k, v, layer, fb, save_kv_cache, **kw).clone()
        return o

    backend.forward_extend = recorded
    try:
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            for _ in range(steps):
                backend.init_forward_metadata(batch)
                actual = run_mla_forward(fixture, batch, inputs)
    finally:
        backend.forward_extend = own
    return KitRun(fixture, actual, expected, attn)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
