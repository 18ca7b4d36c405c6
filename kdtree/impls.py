"""The implementations `kdtree diff` can run or compare against, by name, and `diff_capture`, which runs two
of them on a capture and compares them."""

from __future__ import annotations

from typing import Callable

import torch

from kdtree.capture import Capture
from kdtree.diff import DEFAULT_TOLERANCE, LayerDiff, compare
from kdtree.errors import BadInput
from kdtree.marshal import marshal
from kdtree.model import kernel_model
from kdtree.outputs import AttnOutput, poisoned
from kdtree.reference import emulate_triton, oracle


def _oracle(cap: Capture, layer_id: int, device, fault):
    return oracle(cap, layer_id, device=device)


def _emulation(cap: Capture, layer_id: int, device, fault):
    return emulate_triton(cap, layer_id, device=device)


def _model(cap: Capture, layer_id: int, device, fault):
    args = marshal(cap, fault).to(device)
    layer = cap.layer(layer_id)
    return kernel_model(args, layer.q.to(device), cap.pool(layer_id, device), v_head_dim=cap.meta.v_head_dim)


def _cuda(cap: Capture, layer_id: int, device, fault):
    from kdtree.kernel import VerifyKernel

    if not str(device).startswith("cuda"):
        raise BadInput("--impl cuda runs on a GPU; this machine has none (use --impl model)")
    kern = VerifyKernel.get()
    args = marshal(cap, fault)
    layer = cap.layer(layer_id)
    T, H = cap.num_tokens, cap.meta.num_heads
    o = poisoned((T, H, cap.meta.v_head_dim), device)
    lse = torch.full((T, H), float("nan"), device=device)
    kern.run(args, layer.q.to(device), cap.pool(layer_id, device), o, lse)
    return AttnOutput(o, lse)


def _sglang(cap: Capture, layer_id: int, device, fault):
    from kdtree import sglang

    return AttnOutput(sglang.run(cap, layer_id, device), None)


def _stored(cap: Capture, layer_id: int, device, fault):
    layer = cap.layer(layer_id)
    return AttnOutput(layer.o.to(device), None if layer.lse is None else layer.lse.to(device))


# name -> (function, consumes marshaled arguments, description)
IMPLS: dict[str, tuple[Callable, bool, str]] = {
    "oracle": (_oracle, False, "fp64 attention from the raw SGLang tensors"),
    "emulation": (_emulation, False, "SGLang Triton numerics: bf16 in, fp32 accumulate, P rounded to bf16"),
    "model": (_model, True, "torch model of the CUDA kernel over the marshaled arguments and the NaN pool"),
    "cuda": (_cuda, True, "the CUDA kernel kernels/verify_mla.cu, JIT-compiled with CuPy (needs a GPU)"),
    "sglang": (_sglang, False, "SGLang's Triton extend_attention_fwd, called as its backend does (GPU, SGLang importable)"),
    "capture": (_stored, False, "the o/lse stored in the capture (what SGLang's backend produced)"),
}


def gpu_available() -> bool:
    """A CUDA GPU that torch sees and CuPy to drive it."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def unavailable(name: str) -> str | None:
    """Why implementation `name` cannot run on this machine, or None."""
    if name == "cuda" and not gpu_available():
        return "--impl cuda runs the kernel on a GPU with CuPy; this machine has none (use --impl model)"
    if name == "sglang":
        from kdtree.sglang import extend_attention

        if not torch.cuda.is_available():
            return "sglang runs SGLang's Triton kernel on a GPU; this machine has none"
        fn, why = extend_attention()
        if fn is None:
            return f"SGLang's Triton kernel is not importable here: {why}"
    return None


def default_impl() -> str:
    """The CUDA kernel where there is a GPU, else its torch model."""
    return "cuda" if gpu_available() else "model"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_impl(name: str, cap: Capture, layer_id: int, *, fault: str | None = None, device=None) -> AttnOutput:
    if name not in IMPLS:
        raise BadInput(f"unknown implementation {name!r}; expected one of {', '.join(IMPLS)}")
    fn, marshaled, _ = IMPLS[name]
    if fault is not None and not marshaled:
        marshaled_names = [k for k, v in IMPLS.items() if v[1]]
        raise BadInput(
            f"--inject needs an implementation that reads the marshaled arguments ({', '.join(marshaled_names)}), not {name!r}"
        )
    return fn(cap, layer_id, device or default_device(), fault)


def diff_capture(
    cap: Capture,
    impl: str,
    ref: str = "oracle",
    *,
    fault: str | None = None,
    layers: list[int] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    device=None,
    on_layer=None,
) -> list[LayerDiff]:
    """Run `impl` and `ref` on each layer of `cap` and compare them."""
    results = []
    for lid in layers if layers is not None else cap.meta.layer_ids:
        out = run_impl(impl, cap, lid, fault=fault, device=device)
        want = run_impl(ref, cap, lid, device=device)
        results.append(compare(cap, lid, out, want, tolerance))
        if on_layer is not None:
            on_layer(results[-1])
    return results
