"""The CUDA verify kernel's host code (docs/kernel-design.md):

- `config`: sources, their hash, targets' limits, `KernelConfig`, compile options;
- `nvrtc`: cross-compile reports for any target without a GPU (`compile_report`, `kdtree compile`);
- `planner`: the stream-K plan, the cost model, the workspace;
- `launch`: `VerifyKernel` (CuPy JIT, the sm_90a cubin, the launch with PDL).
"""

from kdtree.kernel.config import (
    ARCH_LIMITS,
    FUSED_MERGE_SEGS,
    FWD,
    KERNEL_DIR,
    MERGE,
    SOURCE,
    KernelCompileError,
    KernelConfig,
    compile_options,
    configs_for,
    device_arch,
    format_compile_error,
    source_files,
    source_hash,
    target_arch,
)
from kdtree.kernel.launch import MERGE_THREADS, VerifyKernel, check_inputs, device_ptr, launch_dependent, pdl_available
from kdtree.kernel.nvrtc import (
    KernelResources,
    compile_report,
    nvrtc_arch,
    nvrtc_compile,
    nvrtc_version,
    parse_ptxas,
    use_nvrtc_library,
)
from kdtree.kernel.planner import (
    FEW_UNIT_COST,
    FWD_ARRAYS,
    PLAN_ARRAYS,
    SEGMENT_COST_PER_ROW,
    SEGMENT_OVERHEAD_UNITS,
    UNIT_COST,
    LaunchPlan,
    Workspace,
    balanced_split,
    choose_plan,
    estimated_cost,
    plan,
)

__all__ = [
    "ARCH_LIMITS",
    "FEW_UNIT_COST",
    "FUSED_MERGE_SEGS",
    "FWD",
    "FWD_ARRAYS",
    "KERNEL_DIR",
    "KernelCompileError",
    "KernelConfig",
    "KernelResources",
    "LaunchPlan",
    "MERGE",
    "MERGE_THREADS",
    "PLAN_ARRAYS",
    "SEGMENT_COST_PER_ROW",
    "SEGMENT_OVERHEAD_UNITS",
    "SOURCE",
    "UNIT_COST",
    "VerifyKernel",
    "Workspace",
    "balanced_split",
    "check_inputs",
    "choose_plan",
    "compile_options",
    "compile_report",
    "configs_for",
    "device_arch",
    "device_ptr",
    "estimated_cost",
    "format_compile_error",
    "launch_dependent",
    "nvrtc_arch",
    "nvrtc_compile",
    "nvrtc_version",
    "parse_ptxas",
    "pdl_available",
    "plan",
    "source_files",
    "source_hash",
    "target_arch",
    "use_nvrtc_library",
]
