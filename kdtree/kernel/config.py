"""The verify kernel's sources and configurations: where the .cu files are, their hash (the JIT recompiles when
any of them changes), each target's limits, the tile configuration (`KernelConfig`, mirroring
kernels/verify_mla_config.cuh) and the compile options. docs/kernel-design.md, "Per-target configuration"."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The kernel sources, found one way (docs/kernel-design.md, "Sources"): kdtree/kernels, in a checkout a link to the
# kernels/ folder at its top (so an editable install, or the checkout on PYTHONPATH, compiles what you edit there),
# in a wheel the files themselves. Resolved, so that a checkout's KERNEL_DIR.parent is its root.
KERNEL_DIR = (Path(__file__).resolve().parents[1] / "kernels").resolve()
POOL_ROW_BYTES = 576 * 2  # a pool row: kv_lora_rank 512 + rope 64, bf16
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
    wg_pipe: int = 0  # dims_split body: 1 = QK of tile t and P V of tile t-1 in flight together (3 stages)
    split_keys: bool = False  # the split_keys body (wgmma; False: dims_split): each warpgroup scores its own tile of
    # a 64-key step over all dims (no partial-score exchange; 4 stages, wg_pipe 0)
    blocks64: bool = False  # the blocks64 body (split_keys layout): FlashMLA's schedule on 64-key blocks
    # (verify_segment_blocks64; QK at N 64, the running max passed between the warpgroups, no few-row tiles)
    few_rows: int = 0  # wgmma segment: row tiles of at most this many rows (<= 16) run the mma.sync few-row
    # segment, at few_row_weight(config) of a unit (0: every tile is a 64-row wgmma tile)
    extra: tuple[tuple[str, int], ...] = ()  # more -D switches (timing experiments)

    @property
    def s_pad(self) -> int:
        """fp32 padding of a partial-score row (VMLA_S_PAD, default 8; 0: unpadded and swizzled, BN 16 only)."""
        return dict(self.extra).get("VMLA_S_PAD", 8)

    def __post_init__(self) -> None:
        if self.split_keys and not (self.wgmma and self.stages == 4 and self.wg_pipe == 0):
            raise ValueError(
                f"KernelConfig.split_keys needs the wgmma body with stages=4 and wg_pipe=0 "
                f"(got wgmma={self.wgmma}, stages={self.stages}, wg_pipe={self.wg_pipe})"
            )
        if self.blocks64 and not (self.split_keys and self.few_rows == 0):
            raise ValueError(
                f"KernelConfig.blocks64 needs split_keys and few_rows=0 (beside the few-row segment it spills; got "
                f"split_keys={self.split_keys}, few_rows={self.few_rows})"
            )

    @classmethod
    def for_arch(cls, arch: str) -> "KernelConfig":
        """sm_120-class parts (101,376 B of shared memory per block): 32 rows per block with Q in registers.
        Hopper (sm_90, compiled as sm_90a): the warpgroup-MMA segment, 64 rows (25 % faster than mma.sync at
        64 rows on the H200's long cases), each warpgroup on its own tile of a 64-key step. Other parts with ~227 KB (sm_100): 64 rows per block with Q in
        shared memory, which halves the pool bytes each block pulls from L2 per FLOP (v2 measured the
        32-row kernel L2-bound on an H200)."""
        if arch in ("sm_90", "sm_90a"):
            return cls(bm=64, rgroups=2, khalves=1, q_smem=True, wgmma=True, stages=4, split_keys=True, few_rows=16)
        if arch == "sm_90a-blocks64":  # the blocks64 body alone (no few-row tiles beside it)
            return dataclasses.replace(cls.for_arch("sm_90a"), few_rows=0, blocks64=True)
        if ARCH_LIMITS.get(arch, {}).get("smem_per_block", 0) >= 200_000:
            return cls(bm=64, rgroups=2, khalves=1, q_smem=True)
        return cls()

    @classmethod
    def candidates(cls, arch: str) -> tuple["KernelConfig", ...]:
        """The configurations `choose_plan` picks from on this target, the default first: parts with ~227 KB
        also have the 32-row kernel, which wins on small batches of short trees (fewer padding rows); on Hopper
        blocks64 (the long batches: ~0.82 of a split_keys unit, but each segment costs more and it has no few-row
        tiles) and split_keys without few-row tiles (a batch whose row tiles fill the grid one a block, such as
        32k x4, would otherwise be split everywhere to balance the cheaper tiles).
        "sm_90a" names the split_keys body with few-row tiles alone and "sm_90a-blocks64" the blocks64 body alone
        (KDTREE_KERNEL_TARGET, `kdtree bench --target`: tests, compute-sanitizer, tools and experiments)."""
        first = cls.for_arch(arch)
        if first == cls() or arch in ("sm_90a", "sm_90a-blocks64"):
            return (first,)
        if first.few_rows:
            nofew = dataclasses.replace(first, few_rows=0)
            return (first, dataclasses.replace(nofew, blocks64=True), nofew, cls())
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
            "VMLA_SPLIT_KEYS": int(self.split_keys),
            "VMLA_BLOCKS64": int(self.blocks64),
            "VMLA_FEW_ROWS": self.few_rows,
            "VMLA_FUSED_MERGE_SEGS": FUSED_MERGE_SEGS,  # the plan's bound, so the two cannot disagree
            "VMLA_SMEM_BYTES": self.smem_bytes,  # checked against the kernel's own size by a static_assert
        }

    def with_defines(self, defines) -> "KernelConfig":
        """This configuration with more -D switches, given as "NAME=VALUE" strings (a script's --define)."""
        extra = []
        for d in defines:
            name, sep, value = d.partition("=")
            if not sep or not name or not value.lstrip("-").isdigit():
                raise ValueError(f"--define {d!r}: expected NAME=INTEGER")
            extra.append((name, int(value)))
        return dataclasses.replace(self, extra=self.extra + tuple(extra))

    @classmethod
    def rows64_in_registers(cls) -> "KernelConfig":
        """mma.sync on 64 rows within sm_120's 101,376 B: Q in registers (72 a thread, staged through all four
        stages of 16 keys), 4 dim slices x 2 row groups, the partial-score rows unpadded and swizzled. Each gathered
        pool row serves 64 rows instead of 32 (docs/kernel-design.md, "The two numbers")."""
        return cls(bm=64, bn=16, stages=4, dslices=4, rgroups=2, khalves=1, extra=(("VMLA_S_PAD", 0),))

    @property
    def body(self) -> str:
        """The segment body's one name (plans, reports, tools' labels): `mma32`/`mma64` (mma.sync at BM rows), the
        wgmma bodies `dims_split`, `split_keys` and `blocks64`, with `+few` where few-row tiles run beside it."""
        if not self.wgmma:
            return f"mma{self.bm}"
        name = "blocks64" if self.blocks64 else "split_keys" if self.split_keys else "dims_split"
        return name + ("+few" if self.few_rows else "")

    def dims_split(self) -> "KernelConfig":
        """The same wgmma configuration on the dims_split body (the warpgroups splitting a tile's dims, pipelined,
        3 stages): the loop split_keys replaced, kept as its reference."""
        return dataclasses.replace(self, stages=3, wg_pipe=1, split_keys=False)

    def in_unit_order(self) -> "KernelConfig":
        """The same configuration built to run each block's segments in unit order (VMLA_LAST_SEGMENT_FIRST=0): the
        order's bit-equality and timing twin."""
        return self.with_defines(["VMLA_LAST_SEGMENT_FIRST=0"])

    @property
    def last_segment_first(self) -> bool:
        """A block runs its last segment first (VMLA_LAST_SEGMENT_FIRST, default 1): that segment starts at its row
        tile's key 0, so the blocks of a request read its keys at about the same offsets at the same time and the
        rows stay in L2 between them (docs/kernel-design.md, "Pool rows over L2"). The order changes no bits."""
        return bool(dict(self.extra).get("VMLA_LAST_SEGMENT_FIRST", 1))

    @property
    def few_row_limit(self) -> int:
        """Row tiles of at most this many rows run the few-row segment (only the wgmma body has one)."""
        return self.few_rows if self.wgmma else 0

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of verify_mla_fwd: sizeof(Smem) of the body (kernels/verify_mla_body_*.cuh)."""
        if self.wgmma:  # verify_mla_wgmma_common.cuh: Q and the stages as unpadded swizzled rows, two P tiles, two
            # partial-score buffers (split_keys: two rows of row statistics), the slot-id ring, a flag; + 1024 B to
            # align the atoms
            scores = 2 * 64 * 2 * 4 if self.split_keys else 2 * 64 * (self.bn + 8) * 4
            ring = 5 if self.split_keys else 2 * self.stages
            return 64 * 576 * 2 + self.stages * self.bn * 576 * 2 + 2 * 64 * self.bn * 2 + scores + ring * self.bn * 4 + 16 + 1024
        row = (576 + 8) * 2  # a pool row or Q row, padded by 16 B
        q = self.bm * row if self.q_smem else 0
        kv = self.stages * self.bn * row
        idx = 2 * self.stages * self.bn * 4  # ring of slot ids fetched ahead of the rows
        s = self.dslices * self.bm * (self.bn + self.s_pad) * 4  # fp32 partial scores
        p = self.bm * (self.bn + 8) * 2  # bf16 probabilities
        stats = 2 * self.bm * 4 + 16  # alpha, l per row; a flag
        return q + kv + idx + s + p + stats


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


# What $KDTREE_KERNEL_TARGET may name: a target, or the blocks64 body alone (`KernelConfig.candidates`)
TARGET_NAMES = (*ARCH_LIMITS, "sm_90a-blocks64")


def target_arch() -> str:
    """The present GPU's target, or the one named by $KDTREE_KERNEL_TARGET (e.g. sm_120: run the RTX PRO
    6000's configuration on an H200, which has room for it); a name outside TARGET_NAMES is a ValueError (a typo
    would otherwise run the default 32-row configuration)."""
    named = os.environ.get("KDTREE_KERNEL_TARGET")
    if named and named not in TARGET_NAMES:
        raise ValueError(f"KDTREE_KERNEL_TARGET={named!r}: expected one of {', '.join(TARGET_NAMES)}")
    return named or device_arch()


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
