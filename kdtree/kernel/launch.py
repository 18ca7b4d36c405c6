"""The kernel on the present GPU: CuPy JIT (and, for Hopper's wgmma body, an sm_90a cubin), and the launch on
torch's current stream, the merge as a programmatic dependent where the GPU has it (docs/kernel-design.md,
"Merge"). `launch()` is CUDA-graph safe: everything on the device beforehand, no allocation, no host sync."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np
import torch

from kdtree.kernel.config import (
    FWD,
    MERGE,
    SOURCE,
    KernelCompileError,
    KernelConfig,
    compile_options,
    configs_for,
    device_arch,
    format_compile_error,
    source_hash,
)
from kdtree.kernel.nvrtc import _nvrtc_include_dirs
from kdtree.kernel.planner import FWD_ARRAYS, LaunchPlan, Workspace, choose_plan
from kdtree.marshal import VerifyArgs


# ----- programmatic dependent launch ---------------------------------------------------------------
class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_CTYPES = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}
_PDL_CONFIGS: dict[tuple, tuple] = {}


@functools.cache
def _cu_launch_kernel_ex():
    """The driver's cuLaunchKernelEx (CUDA 12) through ctypes, or None."""
    try:
        f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


def pdl_available() -> bool:
    """verify_mla_merge launched as a programmatic dependent of verify_mla_fwd: needs a Hopper-or-newer GPU, a
    driver with cuLaunchKernelEx and KDTREE_PDL not 0. Otherwise a plain launch."""
    if os.environ.get("KDTREE_PDL", "1") == "0" or torch.cuda.get_device_capability()[0] < 9:
        return False
    return _cu_launch_kernel_ex() is not None


def launch_dependent(fn, grid: int, block: int, args: tuple, stream: int) -> None:
    """Launch CuPy function `fn` (np.uint64 pointers, np.int32, np.float32 arguments) on `stream` with
    programmatic stream serialisation (the driver's cuLaunchKernelEx through ctypes: cuda.bindings' driver-table
    probe makes failing cuGetProcAddress calls that compute-sanitizer reports): it may start before the
    previous kernel ends and waits for it in `griddepcontrol.wait`. The launch configuration is built once per
    (function, grid, block, stream)."""
    key = (id(fn), grid, block, stream)
    if key not in _PDL_CONFIGS:
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = _LaunchConfig((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(block, 1, 1), 0, stream, ctypes.pointer(attr), 1)
        _PDL_CONFIGS[key] = (cfg, attr, getattr(fn, "kernel", fn).ptr, fn)
    cfg, _, func, _ = _PDL_CONFIGS[key]
    values = [_CTYPES[type(a)](a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    err = _cu_launch_kernel_ex()(ctypes.byref(cfg), func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx({getattr(fn, 'name', fn)}) failed: CUresult {err}")


# ----- the kernels' parameters: filled here, for every launch --------------------------------------
class FwdParams(ctypes.Structure):
    """verify_mla_fwd's parameters, member for member (kernels/verify_mla_params.cuh, VMLA_FWD_PARAMS: device
    pointers as uint64); tests/test_params.py checks this layout against the device's."""

    _fields_ = [
        ("q", ctypes.c_uint64),
        ("kv_buffer", ctypes.c_uint64),
        ("qo_indptr", ctypes.c_uint64),
        ("kv_indptr", ctypes.c_uint64),
        ("kv_indices", ctypes.c_uint64),
        ("prefix_lens", ctypes.c_uint64),
        ("tree_mask", ctypes.c_uint64),
        ("mask_words", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("sm_scale", ctypes.c_float),
        ("logit_cap", ctypes.c_float),
        ("o", ctypes.c_uint64),
        ("lse", ctypes.c_uint64),
        *((name, ctypes.c_uint64) for name in FWD_ARRAYS),  # the plan's arrays
        ("part_o", ctypes.c_uint64),
        ("part_lse", ctypes.c_uint64),
        ("rt_counter", ctypes.c_uint64),
    ]


class MergeParams(ctypes.Structure):
    """verify_mla_merge's parameters (kernels/verify_mla_params.cuh, VMLA_MERGE_PARAMS)."""

    _fields_ = [
        ("row_merge", ctypes.c_uint64),
        ("part_o", ctypes.c_uint64),
        ("part_lse", ctypes.c_uint64),
        ("o", ctypes.c_uint64),
        ("lse", ctypes.c_uint64),
    ]


def fwd_params(
    p: LaunchPlan,
    args: VerifyArgs,
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor | None,
    ws: Workspace,
) -> FwdParams:
    """verify_mla_fwd's parameters for plan `p` (everything on the device; lse and, without the fused merge, the
    merge counters may be None: null)."""
    return FwdParams(
        q=_address(q),
        kv_buffer=_address(kv_buffer),
        qo_indptr=_address(args.qo_indptr),
        kv_indptr=_address(args.combined_kv_indptr),
        kv_indices=_address(args.combined_kv_indices),
        prefix_lens=_address(args.prefix_lens),
        tree_mask=_address(args.tree_mask),
        mask_words=p.mask_words,
        num_heads=p.num_heads,
        sm_scale=args.sm_scale,
        logit_cap=args.logit_cap,
        o=_address(o),
        lse=_address(lse),
        **{name: _address(p.arrays[name]) for name in FWD_ARRAYS},
        part_o=_address(ws.part_o),
        part_lse=_address(ws.part_lse),
        rt_counter=_address(ws.rt_counter if p.fused_merge else None),
    )


def merge_params(p: LaunchPlan, o: torch.Tensor, lse: torch.Tensor | None, ws: Workspace) -> MergeParams:
    """verify_mla_merge's parameters for plan `p`."""
    return MergeParams(
        row_merge=_address(p.arrays["row_merge"]),
        part_o=_address(ws.part_o),
        part_lse=_address(ws.part_lse),
        o=_address(o),
        lse=_address(lse),
    )


_NUMPY = {ctypes.c_uint64: np.uint64, ctypes.c_int32: np.int32, ctypes.c_float: np.float32}


def kernel_args(params: ctypes.Structure) -> tuple:
    """A parameter struct's members in order, as the kernel's arguments (np.uint64, np.int32, np.float32: CuPy and
    `launch_dependent` pass each by its own pointer; the driver places them at the struct's offsets, which
    tests/test_params.py checks are the kernel's)."""
    return tuple(_NUMPY[t](getattr(params, name)) for name, t in params._fields_)


def _address(t: torch.Tensor | None) -> int:
    """A tensor's device address (0 for None)."""
    return 0 if t is None else t.data_ptr()


def device_ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a CuPy kernel argument (0 for None)."""
    return np.uint64(_address(t))


# ----- CuPy JIT ----------------------------------------------------------------------------------
# verify_mla_merge's threads a row (64: two float4 of the row a thread, one wave of the H200 for the small tree's
# 2,176 rows; 128: one float4, 2.5 % slower there on the H200; docs/kernel-design.md, "Merge")
MERGE_THREADS = 64


def sm90a_module(cupy, source: Path, options: tuple[str, ...], entry: str):
    """`source` built for sm_90a (CuPy would pass the GPU's own -arch, and wgmma needs sm_90a): NVRTC through
    CuPy's bindings, then the cubin loaded as a RawModule, `entry` loaded while the file exists.

    Why not `kdtree.kernel.nvrtc.nvrtc_compile` (cuda-bindings), which the reports use: CuPy's NVRTC is the
    one every machine that runs the kernel has (it ships with CuPy, and is the compiler of the mma.sync
    builds), while cuda-bindings is an extra; one compiler for every build the GPU runs keeps them alike."""
    import tempfile

    from cupy_backends.cuda.libs import nvrtc as cnvrtc

    includes = list(_nvrtc_include_dirs())
    cuda_path = cupy.cuda.get_cuda_path()
    if cuda_path and Path(cuda_path, "include", "cuda_bf16.h").exists():
        includes.append(str(Path(cuda_path, "include")))
    opts = ["-arch=sm_90a", *options, *(f"-I{d}" for d in includes)]
    prog = cnvrtc.createProgram(source.read_text(), source.name, (), ())
    try:
        try:
            cnvrtc.compileProgram(prog, opts)
        except cnvrtc.NVRTCError:
            raise KernelCompileError(
                f"{source.name} does not compile for sm_90a:\n" + format_compile_error(cnvrtc.getProgramLog(prog), source)
            ) from None
        cubin = cnvrtc.getCUBIN(prog)
    finally:
        cnvrtc.destroyProgram(prog)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, source.with_suffix(".cubin").name)
        path.write_bytes(cubin)
        module = cupy.RawModule(path=str(path))
        module.get_function(entry)
    return module


class VerifyKernel:
    """verify_mla.cu compiled for the present GPU. `run()` is the convenient path; `launch()` the
    graph-safe one (all tensors on the device, workspace preallocated). With several configurations
    (the target's candidates by default), `plan()` picks one per batch and `launch()` runs the plan's."""

    _cache: dict[tuple, "VerifyKernel"] = {}

    def __init__(self, config: KernelConfig | tuple[KernelConfig, ...] | None = None, source: Path = SOURCE):
        import cupy

        self.cupy = cupy
        self.source = source  # kernels/verify_mla.cu, or another tree's copy (an A/B against a commit)
        self.configs = configs_for(config)
        self.config = self.configs[0]
        self._fns: dict[KernelConfig, tuple] = {}
        self.module, self.fwd, self.merge = self.compiled(self.config)
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.num_sms, self.l2_bytes = props.multi_processor_count, props.L2_cache_size
        self.gpu_name = props.name
        self._streams: dict[int, object] = {}
        self.pdl = pdl_available()
        self.merge_threads = MERGE_THREADS

    def compiled(self, config: KernelConfig) -> tuple:
        """(module, fwd, merge) for `config`, compiled on first use."""
        if config not in self._fns:
            try:
                if config.wgmma:
                    module = self._cubin_module(config)
                else:
                    module = self.cupy.RawModule(
                        code=self.source.read_text(), options=compile_options(config, source=self.source)
                    )
                fwd, merge = module.get_function(FWD), module.get_function(MERGE)
            except self.cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(
                    f"{self.source.name} does not compile:\n" + format_compile_error(str(e), self.source)
                ) from None
            fwd.max_dynamic_shared_size_bytes = config.smem_bytes
            self._fns[config] = (module, fwd, merge)
        return self._fns[config]

    def _cubin_module(self, config: KernelConfig):
        """The module for a configuration CuPy cannot build (it passes the GPU's own -arch, and wgmma needs
        sm_90a): `sm90a_module`."""
        if device_arch() != "sm_90":
            raise KernelCompileError(f"the wgmma configuration runs on sm_90 (Hopper) only, not on {device_arch()}")
        return sm90a_module(self.cupy, self.source, compile_options(config, source=self.source), FWD)

    @classmethod
    def get(cls, config: KernelConfig | tuple[KernelConfig, ...] | None = None, source: Path = SOURCE) -> "VerifyKernel":
        """The compiled kernel, recompiled when kernels/*.cu or a header it includes changed (`source`: another
        tree's verify_mla.cu)."""
        configs = configs_for(config)
        key = (str(source.resolve()), source_hash(source), configs, torch.cuda.current_device())
        if key not in cls._cache:
            cls._cache[key] = cls(configs, source)
        return cls._cache[key]

    def plan(self, args: VerifyArgs, num_heads: int) -> LaunchPlan:
        """The launch plan for this batch on this GPU, with the cheapest of this kernel's configurations (host
        side, before any capture; compiles that configuration if it has not been yet), priced by the cost model
        `kdtree tune` fitted to this GPU, with its measured picks, where it wrote one for this kernel source
        (`kdtree.kernel.tuning.active_tuning`)."""
        from kdtree.kernel.config import target_arch
        from kdtree.kernel.tuning import active_tuning

        t = active_tuning(self.gpu_name, self.num_sms, target_arch()) if self.source == SOURCE else None
        p = choose_plan(
            args,
            num_heads,
            self.num_sms,
            self.configs,
            l2_bytes=self.l2_bytes,
            model=t.model if t else None,
            picks=t.picks if t else None,
        )
        self.compiled(p.config)
        return p

    def resources(self) -> dict:
        a = self.fwd.attributes
        return {"registers": a["num_regs"], "local_bytes": a["local_size_bytes"], "dynamic_smem": self.config.smem_bytes}

    def cupy_stream(self, ts: torch.cuda.Stream):
        """CuPy's view of a torch stream (cached: made once per stream)."""
        key = ts.cuda_stream
        if key not in self._streams:
            cp = self.cupy
            from_external = getattr(cp.cuda.Stream, "from_external", None)
            try:
                self._streams[key] = from_external(ts) if from_external else cp.cuda.ExternalStream(key)
            except TypeError:  # a torch without the CUDA stream protocol
                self._streams[key] = cp.cuda.ExternalStream(key)
        return self._streams[key]

    def launch(
        self,
        p: LaunchPlan,
        args: VerifyArgs,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor | None,
        ws: Workspace,
    ) -> None:
        """Enqueue the kernel(s) on torch's current stream. Everything (args, plan arrays, workspace) must
        already be on the GPU: no allocation, no copy, no sync - graph-capturable."""
        _, fwd, merge = self._fns[p.config]
        with self.cupy_stream(torch.cuda.current_stream()):
            fwd(
                (p.grid, 1, 1),
                (p.config.threads, 1, 1),
                kernel_args(fwd_params(p, args, q, kv_buffer, o, lse, ws)),
                shared_mem=p.config.smem_bytes,
            )
            if p.split and not p.fused_merge:
                merge_args = kernel_args(merge_params(p, o, lse, ws))
                if self.pdl:  # its blocks start during the forward kernel's last wave (no launch gap)
                    launch_dependent(merge, p.total_rows, self.merge_threads, merge_args, torch.cuda.current_stream().cuda_stream)
                else:
                    merge((p.total_rows, 1, 1), (self.merge_threads, 1, 1), merge_args)

    def run(
        self,
        args: VerifyArgs,
        q: torch.Tensor,
        kv_buffer: torch.Tensor,
        o: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        *,
        with_lse: bool = True,
    ):
        """Plan, allocate and launch. q [T, H, 576] bf16, kv_buffer [slots, 1, 576] bf16 on the GPU."""
        check_inputs(args, q, kv_buffer)
        T, H, _ = q.shape
        p = self.plan(args, H).to(q.device)
        o = o if o is not None else torch.empty(T, H, 512, dtype=torch.bfloat16, device=q.device)
        if with_lse and lse is None:
            lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
        ws = Workspace.for_plan(p, q.device)
        dev = args.to(q.device)
        self.launch(p, dev, q.contiguous(), kv_buffer.contiguous(), o, lse, ws)
        return o, lse


def check_inputs(args: VerifyArgs, q: torch.Tensor, kv_buffer: torch.Tensor) -> None:
    """Refuse what the kernel does not handle, with a clear message."""
    if q.dtype != torch.bfloat16 or kv_buffer.dtype != torch.bfloat16:
        raise ValueError(f"q and kv_buffer must be bf16, got {q.dtype} and {kv_buffer.dtype}")
    if q.dim() != 3 or q.shape[-1] != 576:
        raise ValueError(f"q must be [T, H, 576], got {list(q.shape)}")
    if kv_buffer.shape[-1] != 576 or kv_buffer.numel() // 576 != kv_buffer.shape[0]:
        raise ValueError(f"kv_buffer must be [slots, 1, 576], got {list(kv_buffer.shape)}")
    if not q.is_cuda or not kv_buffer.is_cuda:
        raise ValueError("q and kv_buffer must be CUDA tensors")
