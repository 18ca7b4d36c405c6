"""Cross-compilation reports with NVRTC (cuda-bindings; no GPU needed): registers, spills, stack and shared
memory of every kernel for any target, checked against its limits (`kdtree compile`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kdtree.kernel.config import ARCH_LIMITS, FWD, SOURCE, KernelCompileError, KernelConfig, compile_options, format_compile_error


@dataclass
class KernelResources:
    name: str
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    dynamic_smem: int
    threads: int
    bm: int = 0  # the configuration's rows per block
    few_rows: int = 0  # the configuration's few-row tiles (wgmma segment)
    body: str = ""  # the configuration's segment body (KernelConfig.body)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        smem = self.static_smem + self.dynamic_smem
        verdict = "ok" if self.ok else "FAIL: " + "; ".join(self.problems)
        return (
            f"{self.arch:7s} {self.body:14s} {self.name:18s} regs {self.registers:3d}  spill st/ld {self.spill_stores}/{self.spill_loads} B  "
            f"stack {self.stack_bytes} B  smem {smem:,} B ({self.static_smem:,} static)  {self.threads} threads  {verdict}"
        )


def _nvrtc_include_dirs() -> list[str]:
    """CUDA headers for NVRTC: the pip wheels' include folder (nvidia-cuda-runtime), or a toolkit's."""
    dirs = []
    try:
        import nvidia.cu13  # type: ignore

        dirs += [str(Path(p) / "include") for p in nvidia.cu13.__path__]
    except ImportError:
        pass
    try:
        import nvidia.cuda_runtime  # type: ignore  (CUDA 12 wheels)

        dirs += [str(Path(p) / "include") for p in nvidia.cuda_runtime.__path__]
    except ImportError:
        pass
    for root in ("/usr/local/cuda/include",):
        if Path(root, "cuda_bf16.h").exists():
            dirs.append(root)
    return [d for d in dirs if Path(d, "cuda_bf16.h").exists()]


def use_nvrtc_library(path: Path) -> None:
    """Make cuda-bindings use this libnvrtc (e.g. the version CuPy compiles with on a GPU machine: NVRTC
    versions allocate registers differently). Must run before the first NVRTC call in this process."""
    import ctypes

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--nvrtc: no such library: {path}")
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):  # it opens these by name at compile time
        ctypes.CDLL(str(builtins.resolve()), mode=os.RTLD_GLOBAL)
    ctypes.CDLL(str(path.resolve()), mode=os.RTLD_GLOBAL)  # cuda-bindings finds it loaded and takes it


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def nvrtc_arch(arch: str, config: KernelConfig) -> str:
    """The -arch NVRTC needs: the wgmma segment is sm_90a code (Hopper's architecture-specific features)."""
    return "sm_90a" if config.wgmma and arch == "sm_90" else arch


def _nvrtc_output(
    arch: str, config: KernelConfig | None, extra: tuple[str, ...], source: Path, kind: Literal["CUBIN", "PTX"]
) -> tuple[bytes, str]:
    """(NVRTC's `kind` output: "CUBIN" or "PTX", log) of `source` compiled for `arch` with `config`'s switches;
    raises on a failed build."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise RuntimeError("cross-compiling needs NVRTC: pip install -e '.[nvrtc]' (cuda-bindings, nvidia-cuda-nvrtc)") from e
    config = config or KernelConfig.for_arch(arch)
    src = source.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(src, source.name.encode(), 0, [], [])
    try:
        opts = [f"-arch={nvrtc_arch(arch, config)}", "--ptxas-options=-v", *compile_options(config, extra, source)]
        opts += [f"-I{d}" for d in _nvrtc_include_dirs()]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.decode(errors="replace").rstrip("\x00 \n")
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(f"{source.name} does not compile for {arch}:\n" + format_compile_error(log, source))
        _, size = getattr(nvrtc, f"nvrtcGet{kind}Size")(prog)
        out = b" " * size
        getattr(nvrtc, f"nvrtcGet{kind}")(prog, out)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return out, log


def nvrtc_compile(
    arch: str, config: KernelConfig | None = None, extra: tuple[str, ...] = (), source: Path = SOURCE
) -> tuple[bytes, str]:
    """(cubin, log) of kernels/verify_mla.cu (or `source`) for `arch`, through NVRTC (cuda-bindings)."""
    return _nvrtc_output(arch, config, extra, source, "CUBIN")


def nvrtc_ptx(arch: str, config: KernelConfig | None = None, extra: tuple[str, ...] = (), source: Path = SOURCE) -> str:
    """The PTX NVRTC generates for kernels/verify_mla.cu (or `source`) on `arch`: what the source asked for, before
    ptxas schedules it."""
    ptx, _ = _nvrtc_output(arch, config, extra, source, "PTX")
    return ptx.decode(errors="replace").rstrip("\x00")


def parse_ptxas(log: str, arch: str, config: KernelConfig) -> list[KernelResources]:
    """Per-entry resources from `ptxas -v` output."""
    out = []
    for block in re.split(r"ptxas info\s*: Compiling entry function", log)[1:]:
        name = re.search(r"'([^']+)'", block).group(1)
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
        smem = re.search(r"(\d+) bytes smem", block)
        fwd = name == FWD
        r = KernelResources(
            name=name,
            arch=arch,
            registers=regs,
            stack_bytes=int(frame.group(1)),
            spill_stores=int(frame.group(2)),
            spill_loads=int(frame.group(3)),
            static_smem=int(smem.group(1)) if smem else 0,
            dynamic_smem=config.smem_bytes if fwd else 0,
            threads=config.threads if fwd else 128,
            bm=config.bm,
            few_rows=config.few_row_limit,
            body=config.body,
        )
        limits = ARCH_LIMITS.get(arch)
        # ptxas serialised this function's warpgroup MMAs (every wgmma waited for before the next: on the H200 a
        # wgmma under a branch it could not prove uniform did this to the whole kernel, 20 % slower)
        serialised = re.search(rf"\((C75\d\d)\) Potential Performance Loss: wgmma[^\n]*'{re.escape(name)}'", log)
        if serialised:
            r.problems.append(f"wgmma serialised by ptxas ({serialised.group(1)})")
        if r.spill_stores or r.spill_loads:
            r.problems.append(f"register spills ({r.spill_stores} B stored, {r.spill_loads} B loaded)")
        if limits:
            total = r.static_smem + r.dynamic_smem
            if total > limits["smem_per_block"]:
                r.problems.append(f"shared memory {total:,} B > {arch}'s {limits['smem_per_block']:,} B per block")
            if r.registers * r.threads > limits["regs_per_sm"]:
                r.problems.append(f"{r.registers} regs x {r.threads} threads exceed {limits['regs_per_sm']} per SM")
        out.append(r)
    return out


def compile_report(arch: str, config: KernelConfig | None = None, source: Path = SOURCE) -> list[KernelResources]:
    """Resources of every kernel for `arch`, with the configuration that target runs (or `config`), of
    kernels/verify_mla.cu (or `source`)."""
    config = config or KernelConfig.for_arch(arch)
    _, log = nvrtc_compile(arch, config, source=source)
    return parse_ptxas(log, nvrtc_arch(arch, config), config)
