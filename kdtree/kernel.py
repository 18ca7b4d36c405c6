"""The CUDA verify kernel: source tracking, cross-compile reports (NVRTC, no GPU needed), CuPy JIT and launch.

- `compile_report(arch)` compiles `kernels/verify_mla.cu` with NVRTC for any target (sm_120, sm_90, ...)
  on a machine without a GPU and returns, per kernel, registers, spills, stack and shared memory, checked
  against the target's limits.
- `VerifyKernel` JIT-compiles the same source with CuPy for the present GPU, recompiling whenever the
  source **or any header it includes** changes (their hash goes into the compile options, which CuPy's
  cache keys on), and launches on torch's current stream, passing the tensors' device pointers (zero-copy; no
  DLPack export in the launch path, since one can synchronise streams, which a CUDA-graph capture forbids).
  `plan()` + `Workspace` + `launch()` keep the launch CUDA-graph safe: no allocation, no host sync, no
  data-dependent host logic; everything is sized from the batch's upper bounds beforehand.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kdtree.marshal import VerifyArgs

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
SOURCE = KERNEL_DIR / "verify_mla.cu"
FWD, MERGE = "verify_mla_fwd", "verify_mla_merge"

# Per-block shared memory a kernel may opt into, and registers per SM, by target.
ARCH_LIMITS = {
    "sm_80": {"smem_per_block": 166_912, "regs_per_sm": 65_536},
    "sm_86": {"smem_per_block": 101_376, "regs_per_sm": 65_536},
    "sm_89": {"smem_per_block": 101_376, "regs_per_sm": 65_536},
    "sm_90": {"smem_per_block": 232_448, "regs_per_sm": 65_536},
    "sm_90a": {"smem_per_block": 232_448, "regs_per_sm": 65_536},  # sm_90 with wgmma (the Hopper path)
    "sm_100": {"smem_per_block": 232_448, "regs_per_sm": 65_536},
    "sm_120": {"smem_per_block": 101_376, "regs_per_sm": 65_536},
}


class KernelCompileError(RuntimeError):
    """NVRTC rejected the source; the message quotes the offending lines."""


# ----- source and configuration ------------------------------------------------------------------
def source_files(path: Path = SOURCE) -> list[Path]:
    """The .cu and every local header it includes (recursively), in inclusion order."""
    seen: list[Path] = []

    def visit(p: Path) -> None:
        if p in seen:
            return
        seen.append(p)
        for m in re.finditer(r'^\s*#\s*include\s*"([^"]+)"', p.read_text(), re.M):
            inc = (p.parent / m.group(1)).resolve()
            if inc.exists():
                visit(inc)

    visit(path.resolve())
    return seen


def source_hash(path: Path = SOURCE) -> str:
    h = hashlib.sha256()
    for p in source_files(path):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


FUSED_MERGE_SEGS = 4  # split row tiles of at most this many partials are merged in verify_mla_fwd (VMLA_FUSED_MERGE_SEGS)


@dataclass(frozen=True)
class KernelConfig:
    """Tile configuration (mirrors kernels/verify_mla_config.cuh). `for_arch` picks one per target."""

    bm: int = 32  # query rows (node, head) per block
    bn: int = 32  # keys per pipeline stage
    stages: int = 2
    warps: int = 8
    dslices: int = 4  # QK: dims split across warps ...
    rgroups: int = 1  # ... rows split ...
    khalves: int = 2  # ... keys split
    q_smem: bool = False  # Q fragments in registers (False) or read from shared memory every tile (True)
    kpasses: int = 1  # QK of a warp's keys in this many passes (fewer live score registers)
    blocks_per_sm: int = 1  # resident blocks per SM: the persistent grid is this many per SM
    wgmma: bool = False  # the Hopper segment (warpgroup MMAs from swizzled shared memory; sm_90a, BM 64)
    wg_pipe: int = 0  # wgmma segment: 1 = QK of tile t and P V of tile t-1 in flight together (3 stages),
    # 2 = the same with P through shared memory
    few_rows: int = 0  # wgmma segment: row tiles of at most this many rows (<= 16) run the mma.sync few-row
    # segment, at FEW_UNIT_COST of a unit (0: every tile is a 64-row wgmma tile)
    extra: tuple[tuple[str, int], ...] = ()  # more -D switches (timing experiments)

    @classmethod
    def for_arch(cls, arch: str) -> "KernelConfig":
        """sm_120-class parts (101,376 B of shared memory per block): 32 rows per block with Q in registers.
        Hopper (sm_90, compiled as sm_90a): the warpgroup-MMA segment, 64 rows (25 % faster than mma.sync at
        64 rows on the H200's long cases). Other parts with ~227 KB (sm_100): 64 rows per block with Q in
        shared memory, which halves the pool bytes each block pulls from L2 per FLOP (v2 measured the
        32-row kernel L2-bound on an H200)."""
        if arch in ("sm_90", "sm_90a"):
            return cls(bm=64, rgroups=2, khalves=1, q_smem=True, wgmma=True, stages=3, wg_pipe=1, few_rows=16)
        if ARCH_LIMITS.get(arch, {}).get("smem_per_block", 0) >= 200_000:
            return cls(bm=64, rgroups=2, khalves=1, q_smem=True)
        return cls()

    @classmethod
    def candidates(cls, arch: str) -> tuple["KernelConfig", ...]:
        """The configurations `choose_plan` picks from on this target, the default first: parts with ~227 KB
        also have the 32-row kernel, which wins on small batches of short trees (fewer padding rows); on Hopper
        the wgmma segment also without few-row tiles (a batch whose row tiles fill the grid one a block, such as
        32k x4, would otherwise be split everywhere to balance the cheaper tiles).
        "sm_90a" names the wgmma segment alone (KDTREE_KERNEL_TARGET=sm_90a: tests and experiments)."""
        first = cls.for_arch(arch)
        if first == cls() or arch == "sm_90a":
            return (first,)
        if first.few_rows:
            return (first, dataclasses.replace(first, few_rows=0), cls())
        return (first, cls())

    def defines(self) -> dict[str, int]:
        return dict(self.extra) | {
            "VMLA_BM": self.bm,
            "VMLA_BN": self.bn,
            "VMLA_STAGES": self.stages,
            "VMLA_WARPS": self.warps,
            "VMLA_DSLICES": self.dslices,
            "VMLA_RGROUPS": self.rgroups,
            "VMLA_KHALVES": self.khalves,
            "VMLA_Q_SMEM": int(self.q_smem),
            "VMLA_KPASSES": self.kpasses,
            "VMLA_BLOCKS_PER_SM": self.blocks_per_sm,
            "VMLA_WGMMA": int(self.wgmma),
            "VMLA_WG_PIPE": self.wg_pipe,
            "VMLA_FEW_ROWS": self.few_rows,
            "VMLA_FUSED_MERGE_SEGS": FUSED_MERGE_SEGS,  # the plan's bound, so the two cannot disagree
            "VMLA_SMEM_BYTES": self.smem_bytes,  # checked against the kernel's own size by a static_assert
        }

    @property
    def few_row_limit(self) -> int:
        """Row tiles of at most this many rows run the few-row segment (only the wgmma body has one)."""
        return self.few_rows if self.wgmma else 0

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of verify_mla_fwd: sizeof(Smem) in the .cu."""
        if self.wgmma:  # verify_mla_wgmma.cuh: Q and the stages as unpadded swizzled rows, two P tiles, two
            # partial-score buffers, the slot-id ring, a flag; + 1024 B to align the atoms
            return (64 * 576 * 2 + self.stages * self.bn * 576 * 2 + 2 * 64 * self.bn * 2 + 2 * 64 * (self.bn + 8) * 4
                    + 2 * self.stages * self.bn * 4 + 16 + 1024)
        row = (576 + 8) * 2  # a pool row or Q row, padded by 16 B
        q = self.bm * row if self.q_smem else 0
        kv = self.stages * self.bn * row
        idx = 2 * self.stages * self.bn * 4  # ring of slot ids fetched ahead of the rows
        s = self.dslices * self.bm * (self.bn + 8) * 4  # fp32 partial scores
        p = self.bm * (self.bn + 8) * 2  # bf16 probabilities
        stats = 2 * self.bm * 4 + 16  # alpha, l per row; a flag
        return q + kv + idx + s + p + stats


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def target_arch() -> str:
    """The present GPU's target, or the one named by $KDTREE_KERNEL_TARGET (e.g. sm_120: run the RTX PRO
    6000's configuration on an H200, which has room for it)."""
    return os.environ.get("KDTREE_KERNEL_TARGET") or device_arch()


def configs_for(config: KernelConfig | tuple[KernelConfig, ...] | None) -> tuple[KernelConfig, ...]:
    """One configuration, several, or (None) the candidates of the target `target_arch()` names."""
    if isinstance(config, KernelConfig):
        return (config,)
    return tuple(config or KernelConfig.candidates(target_arch()))


def compile_options(config: KernelConfig, extra: tuple[str, ...] = (), source: Path = SOURCE) -> tuple[str, ...]:
    opts = ["-std=c++17", f"-I{source.parent}", f"-DKDTREE_SOURCE_HASH=0x{source_hash(source)}"]
    opts += [f"-D{k}={v}" for k, v in config.defines().items()]
    return tuple(opts) + tuple(extra)


def format_compile_error(log: str, source: Path = SOURCE) -> str:
    """NVRTC log with the offending source line quoted under each error."""
    out = []
    files = {p.name: p.read_text().splitlines() for p in source_files(source)}
    for line in log.splitlines():
        out.append(line)
        m = re.match(r"^(.*?)\((\d+)\): (error|warning)", line)
        if m:
            name, no = Path(m.group(1)).name, int(m.group(2))
            text = files.get(name) or files.get(source.name)
            if text and 0 < no <= len(text):
                out.append(f"    {no:5d} | {text[no - 1]}")
    return "\n".join(out)


# ----- cross-compilation report (NVRTC; no GPU) --------------------------------------------------
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
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        smem = self.static_smem + self.dynamic_smem
        verdict = "ok" if self.ok else "FAIL: " + "; ".join(self.problems)
        return (
            f"{self.arch:7s} {'bm' + str(self.bm) + (f'+f{self.few_rows}' if self.few_rows else ''):8s} {self.name:18s} regs {self.registers:3d}  spill st/ld {self.spill_stores}/{self.spill_loads} B  "
            f"stack {self.stack_bytes} B  smem {smem:,} B (static {self.static_smem:,} + dynamic {self.dynamic_smem:,})  "
            f"threads {self.threads}  {verdict}"
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


def nvrtc_compile(arch: str, config: KernelConfig | None = None, extra: tuple[str, ...] = (), source: Path = SOURCE) -> tuple[bytes, str]:
    """(cubin, log) of kernels/verify_mla.cu (or `source`) for `arch`, through NVRTC (cuda-bindings)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise RuntimeError("cross-compiling needs NVRTC: pip install -e '.[nvrtc]' (cuda-bindings, nvidia-cuda-nvrtc)") from e
    config = config or KernelConfig.for_arch(arch)
    src = source.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(src, source.name.encode(), 0, [], [])
    opts = [f"-arch={nvrtc_arch(arch, config)}", "--ptxas-options=-v", *compile_options(config, extra, source)]
    opts += [f"-I{d}" for d in _nvrtc_include_dirs()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, buf)
    log = buf.decode(errors="replace").rstrip("\x00 \n")
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelCompileError(f"{source.name} does not compile for {arch}:\n" + format_compile_error(log, source))
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log


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
        )
        limits = ARCH_LIMITS.get(arch)
        # ptxas serialised this function's warpgroup MMAs (every wgmma waited for before the next: on the H200 a
        # wgmma under a branch it could not prove uniform did this to the whole kernel, 20 % slower; session 6)
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


def compile_report(arch: str, config: KernelConfig | None = None) -> list[KernelResources]:
    """Resources of every kernel for `arch`, with the configuration that target runs (or `config`)."""
    config = config or KernelConfig.for_arch(arch)
    _, log = nvrtc_compile(arch, config)
    return parse_ptxas(log, nvrtc_arch(arch, config), config)


# ----- launch planning (host side, outside the launch path) --------------------------------------
FWD_ARRAYS = ("cta_unit_start", "cta_first_rt", "rt_unit_start", "rt_request", "rt_row0", "rt_first_cta", "rt_seg_base")
# (+ verify_mla_merge's per-row (first partial line, partials), [T * H, 2])
PLAN_ARRAYS = FWD_ARRAYS + ("row_merge",)


@dataclass
class LaunchPlan:
    """A stream-K split of one batch: the (row tile, key tile) work units shared by `grid` blocks (`balanced_split`).

    The arrays are int32; `to(device)` moves them once, before any launch or graph capture. For CUDA-graph
    replay with other lengths, plan again and copy the new arrays into the captured ones (same sizes when
    planned from the same upper bounds).
    """

    batch_size: int
    num_heads: int
    total_rows: int  # T * H
    mask_words: int
    grid: int  # persistent blocks
    units: int  # (row tile, key tile) work units
    work: float  # the units weighted by their row tile's cost (few-row tiles are cheaper)
    segments: int  # partial slots (row tiles split across blocks, one slot per block touching them)
    fused_merge: bool  # the last block of each split tile merges it (no verify_mla_merge launch)
    config: KernelConfig
    arrays: dict[str, torch.Tensor] = field(repr=False)

    @property
    def split(self) -> bool:
        return self.segments > 0

    @property
    def row_tiles(self) -> int:
        return len(self.arrays["rt_request"])

    def to(self, device) -> "LaunchPlan":
        return dataclasses.replace(self, arrays={k: v.to(device) for k, v in self.arrays.items()})

    def walk(self) -> list[tuple[int, int, int, int, int | None]]:
        """verify_mla_fwd's loop replayed on the host: (block, row tile, first key tile, end key tile, partial
        slot or None) for every segment, block by block (tests and scripts/trace_case.py)."""
        a = {k: v.cpu().numpy() for k, v in self.arrays.items()}
        out = []
        for c in range(self.grid):
            u, u_end, rt = a["cta_unit_start"][c], a["cta_unit_start"][c + 1], a["cta_first_rt"][c]
            while u < u_end:
                t0, t1 = a["rt_unit_start"][rt], a["rt_unit_start"][rt + 1]
                seg_end = min(u_end, t1)
                segs = a["rt_seg_base"][rt + 1] - a["rt_seg_base"][rt]
                slot = int(a["rt_seg_base"][rt] + (c - a["rt_first_cta"][rt])) if segs > 1 else None
                out.append((c, int(rt), int(u - t0), int(seg_end - t0), slot))
                u, rt = seg_end, rt + 1
        return out


# What a block pays for each segment it works on beyond its tiles, in units. The H200 trace of the wgmma segment
# (scripts/trace_case.py, session 5) puts 6.4 us of a segment in its prologue, first tile's wait and store, against
# 1.9-2.0 us a tile (3.3 units), and the first tiles after a segment starts run slower still; timed side by side,
# 4 to 6 did best (small tree 0.072-0.073 ms against 0.074 at 3 and 0.076 with equal shares; the mixed batch
# 0.33-0.34 against 0.38 and 0.45). docs/kernel-notes.md, "Session 5".
SEGMENT_OVERHEAD_UNITS = 5.0
# A unit of a few-row tile (at most KernelConfig.few_rows rows: the mma.sync segment of the wgmma body) in units
# of a 64-row wgmma unit. Timed on the H200 at weights 0.3-0.7 (session 8 runs 3-4, docs/kernel-notes.md): the
# 128k case puts the tile's real cost near 0.6, and 0.6 did best or near it on every case with few-row tiles.
FEW_UNIT_COST = 0.6


def balanced_split(rt_unit_start: np.ndarray, grid: int, segment_units: float, rt_weight: np.ndarray | None = None) -> np.ndarray:
    """Block boundaries [grid + 1] over the units that even out each block's work + segment_units per row tile
    it starts or continues (0: equal unit counts). A unit of row tile rt is rt_weight[rt] of work (default 1;
    few-row tiles are cheaper). Every block keeps at least one unit.

    The cost of units [a, b) is W(b) - W(a) + segment_units, with W(u) = the work of the units before u +
    segment_units * (row tile of u): equal steps of W give equal costs, and a boundary that falls in the jump
    between two row tiles lands on the second one's start (no split)."""
    units = int(rt_unit_start[-1])
    if segment_units <= 0:
        return np.arange(grid + 1) * units // grid
    starts = rt_unit_start[:-1].astype(np.float64)
    weight = np.ones(len(starts)) if rt_weight is None else np.asarray(rt_weight, dtype=np.float64)
    work = np.diff(rt_unit_start) * weight
    w_start = np.concatenate([[0.0], np.cumsum(work)[:-1]]) + segment_units * np.arange(len(starts))  # W at each row tile's first unit
    w_end = work.sum() + segment_units * (len(starts) - 1)
    w = np.arange(1, grid) * (w_end / grid)
    rt = np.searchsorted(w_start, w, side="right") - 1
    inner = np.minimum(rt_unit_start[rt + 1], starts[rt] + np.rint((w - w_start[rt]) / weight[rt])).astype(np.int64)
    bounds = np.concatenate([[0], inner, [units]])
    idx = np.arange(grid + 1)
    bounds = np.maximum.accumulate(np.maximum(bounds, 0) - idx) + idx  # strictly increasing ...
    return np.minimum(bounds, units - grid + idx)  # ... and every block keeps a unit (grid <= units)


def plan(args: VerifyArgs, num_heads: int, num_sms: int, config: KernelConfig, *,
         fused_merge: bool | None = None, segment_units: float | None = None,
         few_unit_cost: float = FEW_UNIT_COST) -> LaunchPlan:
    """Cut the batch into row tiles x key tiles and share the units among the persistent blocks
    (`config.blocks_per_sm` per SM) so that each block's units plus `segment_units` (default
    SEGMENT_OVERHEAD_UNITS) per segment come out even (`balanced_split`; a request's last row tile costs about as
    much per unit as a full one, measured: weighting it lighter was slower - except a tile of at most
    `config.few_rows` rows, which the few-row segment runs at `few_unit_cost` of a unit).
    `fused_merge` (default: when no tile is split into more than FUSED_MERGE_SEGS partials, on the mma.sync
    paths) lets the kernel merge split tiles itself instead of launching verify_mla_merge."""
    n = (args.qo_indptr[1:] - args.qo_indptr[:-1]).numpy().astype(np.int64)
    kv = (args.combined_kv_indptr[1:] - args.combined_kv_indptr[:-1]).numpy().astype(np.int64)
    row_tiles = -(-n * num_heads // config.bm)
    key_tiles = np.maximum(1, -(-kv // config.bn))  # a request with no keys still owns a unit: it writes o = 0
    rt_request = np.repeat(np.arange(len(n)), row_tiles)
    rt_row0 = np.concatenate([np.arange(r) * config.bm for r in row_tiles])
    rt_unit_start = np.concatenate([[0], np.cumsum(key_tiles[rt_request])])
    units = int(rt_unit_start[-1])
    grid = max(1, min(num_sms * config.blocks_per_sm, units))
    tile_rows = np.minimum(config.bm, n[rt_request] * num_heads - rt_row0)
    rt_weight = np.where(tile_rows <= config.few_row_limit, few_unit_cost, 1.0)
    cta_unit_start = balanced_split(rt_unit_start, grid, SEGMENT_OVERHEAD_UNITS if segment_units is None else segment_units,
                                    rt_weight)
    cta_first_rt = np.searchsorted(rt_unit_start, cta_unit_start[:-1], side="right") - 1
    rt_first_cta = np.searchsorted(cta_unit_start, rt_unit_start[:-1], side="right") - 1
    rt_last_cta = np.searchsorted(cta_unit_start, rt_unit_start[1:] - 1, side="right") - 1
    segs = rt_last_cta - rt_first_cta + 1
    rt_seg_base = np.concatenate([[0], np.cumsum(np.where(segs > 1, segs, 0))])
    if fused_merge is None:  # not for the wgmma segment: its merge kernel was 6 % faster on the small tree (run 7)
        fused_merge = bool(segs.max() <= FUSED_MERGE_SEGS) and not config.wgmma
    elif fused_merge and segs.max() > FUSED_MERGE_SEGS:
        raise ValueError(f"fused merge takes tiles of at most {FUSED_MERGE_SEGS} partials; this plan splits one into {segs.max()}")
    # global rows (token * H + head) run row tile by row tile: each row's tile and its row in that tile
    total_rows = int(tile_rows.sum())
    row_rt = np.repeat(np.arange(len(rt_request)), tile_rows)
    tr = np.arange(total_rows) - np.repeat(np.cumsum(tile_rows) - tile_rows, tile_rows)
    row_segs = np.where(segs > 1, segs, 0)[row_rt]
    row_merge = np.stack([np.where(row_segs > 0, rt_seg_base[row_rt] * config.bm + tr, 0), row_segs], axis=1)
    arrays = {
        "cta_unit_start": cta_unit_start,
        "cta_first_rt": cta_first_rt,
        "rt_unit_start": rt_unit_start,
        "rt_request": rt_request,
        "rt_row0": rt_row0,
        "rt_first_cta": rt_first_cta,
        "rt_seg_base": rt_seg_base,
        "row_merge": row_merge.reshape(-1),
    }
    return LaunchPlan(
        batch_size=len(n),
        num_heads=num_heads,
        total_rows=total_rows,
        mask_words=int(args.tree_mask.shape[1]),
        grid=grid,
        units=units,
        work=float(key_tiles[rt_request] @ rt_weight),
        segments=int(rt_seg_base[-1]),
        fused_merge=fused_merge and bool(rt_seg_base[-1] > 0),
        config=config,
        arrays={k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int32)) for k, v in arrays.items()},
    )


# Relative time of one (row tile, key tile) unit, by kind of segment, and of a segment (prologue, pipeline fill,
# partial store and merge; about proportional to BM), in units of a wgmma unit. Least-squares fit of
# time = units * u + segments * s per configuration to the eight bench cases of one H200 run
# (docs/bench/session4-experiments-h200.log, run 6): u(BM 32) / u(wgmma) = 0.86, s / u = 19.2 at BM 64 and 10.5 at
# BM 32 (0.30 and 0.33 a row); mma.sync at BM 64 measured 1.30-1.34x the wgmma time on the long cases.
UNIT_COST = {"wgmma64": 1.0, "mma64": 1.33, "mma32": 0.86}
SEGMENT_COST_PER_ROW = 0.3


def estimated_cost(p: LaunchPlan) -> float:
    """A plan's time per block in wgmma units (for choosing between configurations, not a prediction in ms)."""
    kind = f"{'wgmma' if p.config.wgmma else 'mma'}{p.config.bm}"
    unit = UNIT_COST.get(kind, p.config.bm / 64 * UNIT_COST["mma64"])
    return (p.work * unit + p.segments * SEGMENT_COST_PER_ROW * p.config.bm) / p.grid


def choose_plan(args: VerifyArgs, num_heads: int, num_sms: int, configs: tuple[KernelConfig, ...]) -> LaunchPlan:
    """Plan the batch with each configuration and keep the cheapest by `estimated_cost` (the first on ties)."""
    plans = [plan(args, num_heads, num_sms, c) for c in configs]
    return min(plans, key=estimated_cost)


@dataclass
class Workspace:
    """Preallocated fp32 partials of the row tiles split across blocks, and the fused merge's per-tile counters
    (zeros; the kernel leaves them zero)."""

    part_o: torch.Tensor  # [segments, BM, 512]
    part_lse: torch.Tensor  # [segments, BM]
    rt_counter: torch.Tensor  # [row tiles] int32

    @classmethod
    def for_plan(cls, p: LaunchPlan, device="cuda", *, segments: int | None = None, row_tiles: int | None = None) -> "Workspace":
        """Sized for `p`, or for `segments` slots and `row_tiles` tiles (upper bounds, for graphs replayed with
        other lengths)."""
        n = max(1, segments if segments is not None else p.segments)
        bm = p.config.bm
        return cls(
            torch.empty(n, bm, 512, dtype=torch.float32, device=device),
            torch.empty(n, bm, dtype=torch.float32, device=device),
            torch.zeros(max(1, row_tiles if row_tiles is not None else p.row_tiles), dtype=torch.int32, device=device),
        )


# ----- programmatic dependent launch ---------------------------------------------------------------
class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


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
    probe makes failing cuGetProcAddress calls that compute-sanitizer reports, session 7): it may start before the
    previous kernel ends and waits for it in `griddepcontrol.wait`. The launch configuration is built once per
    (function, grid, block, stream)."""
    key = (id(fn), grid, block, stream)
    if key not in _PDL_CONFIGS:
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = _LaunchConfig((ctypes.c_uint * 3)(grid, 1, 1), (ctypes.c_uint * 3)(block, 1, 1), 0, stream,
                            ctypes.pointer(attr), 1)
        _PDL_CONFIGS[key] = (cfg, attr, getattr(fn, "kernel", fn).ptr, fn)
    cfg, _, func, _ = _PDL_CONFIGS[key]
    values = [_CTYPES[type(a)](a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    err = _cu_launch_kernel_ex()(ctypes.byref(cfg), func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx({getattr(fn, 'name', fn)}) failed: CUresult {err}")


# ----- CuPy JIT ----------------------------------------------------------------------------------
# verify_mla_merge's threads a row (64: two float4 of the row a thread, one wave of the H200 for the small tree's
# 2,176 rows; 128: one float4, 2.5 % slower there on the H200 - session 7 run 7)
MERGE_THREADS = 64


class VerifyKernel:
    """verify_mla.cu compiled for the present GPU. `run()` is the convenient path; `launch()` the
    graph-safe one (all tensors on the device, workspace preallocated). With several configurations
    (the target's candidates by default), `plan()` picks one per batch and `launch()` runs the plan's."""

    _cache: dict[tuple, "VerifyKernel"] = {}

    def __init__(self, config: KernelConfig | tuple[KernelConfig, ...] | None = None):
        import cupy

        self.cupy = cupy
        self.configs = configs_for(config)
        self.config = self.configs[0]
        self._fns: dict[KernelConfig, tuple] = {}
        self.module, self.fwd, self.merge = self._compiled(self.config)
        self.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self._streams: dict[int, object] = {}
        self.pdl = pdl_available()
        self.merge_threads = MERGE_THREADS

    def _compiled(self, config: KernelConfig) -> tuple:
        """(module, fwd, merge) for `config`, compiled on first use."""
        if config not in self._fns:
            try:
                if config.wgmma:
                    module = self._cubin_module(config)
                else:
                    module = self.cupy.RawModule(code=SOURCE.read_text(), options=compile_options(config))
                fwd, merge = module.get_function(FWD), module.get_function(MERGE)
            except self.cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(f"{SOURCE.name} does not compile:\n" + format_compile_error(str(e))) from None
            fwd.max_dynamic_shared_size_bytes = config.smem_bytes
            self._fns[config] = (module, fwd, merge)
        return self._fns[config]

    def _cubin_module(self, config: KernelConfig):
        """The module for a configuration CuPy cannot build (it passes the GPU's own -arch, and wgmma needs
        sm_90a): NVRTC through CuPy's bindings, then the cubin loaded as a RawModule."""
        import tempfile

        from cupy_backends.cuda.libs import nvrtc as cnvrtc

        arch = "sm_90a"
        if device_arch() != "sm_90":
            raise KernelCompileError(f"the wgmma configuration runs on sm_90 (Hopper) only, not on {device_arch()}")
        includes = list(_nvrtc_include_dirs())
        cuda_path = self.cupy.cuda.get_cuda_path()
        if cuda_path and Path(cuda_path, "include", "cuda_bf16.h").exists():
            includes.append(str(Path(cuda_path, "include")))
        opts = [f"-arch={arch}", *compile_options(config), *(f"-I{d}" for d in includes)]
        prog = cnvrtc.createProgram(SOURCE.read_text(), SOURCE.name, (), ())
        try:
            try:
                cnvrtc.compileProgram(prog, opts)
            except cnvrtc.NVRTCError:
                raise KernelCompileError(f"{SOURCE.name} does not compile for {arch}:\n"
                                         + format_compile_error(cnvrtc.getProgramLog(prog))) from None
            cubin = cnvrtc.getCUBIN(prog)
        finally:
            cnvrtc.destroyProgram(prog)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "verify_mla.cubin")
            path.write_bytes(cubin)
            module = self.cupy.RawModule(path=str(path))
            module.get_function(FWD)  # loaded now, while the file exists
        return module

    @classmethod
    def get(cls, config: KernelConfig | tuple[KernelConfig, ...] | None = None) -> "VerifyKernel":
        """The compiled kernel, recompiled when kernels/*.cu or a header it includes changed."""
        configs = configs_for(config)
        key = (source_hash(), configs, torch.cuda.current_device())
        if key not in cls._cache:
            cls._cache[key] = cls(configs)
        return cls._cache[key]

    def plan(self, args: VerifyArgs, num_heads: int) -> LaunchPlan:
        """The launch plan for this batch on this GPU, with the cheapest of this kernel's configurations (host
        side, before any capture; compiles that configuration if it has not been yet)."""
        p = choose_plan(args, num_heads, self.num_sms, self.configs)
        self._compiled(p.config)
        return p

    def resources(self) -> dict:
        a = self.fwd.attributes
        return {"registers": a["num_regs"], "local_bytes": a["local_size_bytes"], "dynamic_smem": self.config.smem_bytes}

    def _stream(self, ts: torch.cuda.Stream):
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

    def _ptr(self, t: torch.Tensor | None):
        return np.uint64(0 if t is None else t.data_ptr())

    def launch(self, p: LaunchPlan, args: VerifyArgs, q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor | None, ws: Workspace) -> None:
        """Enqueue the kernel(s) on torch's current stream. Everything (args, plan arrays, workspace) must
        already be on the GPU: no allocation, no copy, no sync - graph-capturable."""
        i32, f32 = np.int32, np.float32
        pa = p.arrays
        _, fwd, merge = self._fns[p.config]
        with self._stream(torch.cuda.current_stream()):
            fwd(
                (p.grid, 1, 1),
                (p.config.threads, 1, 1),
                (
                    self._ptr(q), self._ptr(kv_buffer), self._ptr(args.qo_indptr), self._ptr(args.combined_kv_indptr),
                    self._ptr(args.combined_kv_indices), self._ptr(args.prefix_lens), self._ptr(args.tree_mask),
                    i32(p.mask_words), i32(p.num_heads), f32(args.sm_scale), f32(args.logit_cap),
                    self._ptr(o), self._ptr(lse),
                    *(self._ptr(pa[name]) for name in FWD_ARRAYS),
                    self._ptr(ws.part_o), self._ptr(ws.part_lse), self._ptr(ws.rt_counter if p.fused_merge else None),
                ),
                shared_mem=p.config.smem_bytes,
            )
            if p.split and not p.fused_merge:
                merge_args = (self._ptr(pa["row_merge"]), self._ptr(ws.part_o), self._ptr(ws.part_lse), self._ptr(o), self._ptr(lse))
                if self.pdl:  # its blocks start during the forward kernel's last wave (no launch gap)
                    launch_dependent(merge, p.total_rows, self.merge_threads, merge_args, torch.cuda.current_stream().cuda_stream)
                else:
                    merge((p.total_rows, 1, 1), (self.merge_threads, 1, 1), merge_args)

    def run(self, args: VerifyArgs, q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, *, with_lse: bool = True):
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
