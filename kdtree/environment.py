"""What a result was measured on: the GPU, its driver and the software, recorded by `kdtree report`, `kdtree
server-check` and `kdtree bench --server`, so their numbers never travel without their machine."""

from __future__ import annotations

import importlib.metadata
import os
import platform

# what a multi-GPU server's NCCL is told (NVLink multicast off where a machine requires it)
NCCL_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None where it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe() -> dict:
    """The Python, torch, CUDA, CuPy, SGLang, Triton and transformers versions, and the GPU: its name, capability,
    SMs, memory, L2 and driver, and how many a process sees."""
    import torch

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupy": next((v for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if (v := version(d))), None),
        "sglang": version("sglang"),
        "triton": version("triton"),
        "transformers": version("transformers"),
        "kdtree": version("kdtree"),
        "gpu": None,
        "gpus": 0,
    }
    if torch.cuda.is_available():
        from kdtree.selfcheck import driver_version

        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env |= {
            "gpu": p.name,
            "gpus": torch.cuda.device_count(),
            "capability": f"sm_{p.major}{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "l2_bytes": getattr(p, "L2_cache_size", None),
        }
        driver = driver_version()  # (where CuPy cannot ask the driver, the selfcheck's key names torch's CUDA instead)
        env["driver"] = driver if driver.startswith("CUDA driver") else None
    env["nccl_env"] = {k: os.environ[k] for k in NCCL_ENV if k in os.environ}
    return env
