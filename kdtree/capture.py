"""Capture format v1: one TARGET_VERIFY `forward_extend` step of one TP rank, in one safetensors file.

Tensor names are SGLang's (see docs/capture-format.md). Layer-independent tensors sit at the top level;
per-layer tensors are namespaced `layers.<id>.<name>`. The pool is stored sparsely: the rows the step
references (`layers.<id>.kv_buffer`) at the slot ids `kv_buffer_slots`, plus `pool_size`/`page_size`
so a kernel sees SGLang's original slot numbering in a rebuilt pool whose other slots are NaN.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kdtree.errors import BadInput
from kdtree.files import atomic_path, parse_json
from kdtree.format import (  # noqa: F401 - the format's names, re-exported where they were always imported from
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYER_TENSORS,
    OPTIONAL_LAYER_TENSORS,
    OPTIONAL_SHARED_TENSORS,
    POOL_SLOTS,
    SHARED_TENSORS,
    CaptureError,
    layer_key,
)
from kdtree.surgery import select_requests
from kdtree.trees import depths as tree_depths
from kdtree.trees import parents_from_mask
from kdtree.validate import check_finite, validate_capture


@dataclass
class CaptureMeta:
    """Everything about a capture that is not a tensor."""

    num_heads: int  # H per rank
    sm_scale: float  # layer.scaling, read from the layer
    layer_ids: list[int]
    pool_size: int  # kv_buffer has pool_size + page_size rows; slot 0 is padding
    page_size: int = 1
    logit_cap: float = 0.0
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    model: str = "unknown"
    tp_rank: int = 0
    tp_size: int = 1
    spec_algorithm: str = "unknown"  # DDTREE, EAGLE, DFLASH, ...
    tree_budget: int | None = None
    num_draft_tokens: int | None = None
    source: dict[str, Any] = field(default_factory=lambda: {"kind": "unknown"})
    reference: str = "unknown"  # what produced `o`: "sglang:triton extend_attention_fwd", "kdtree:oracle-fp64", ...
    sglang_version: str | None = None

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def v_head_dim(self) -> int:
        return self.kv_lora_rank

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> "CaptureMeta":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise CaptureError(where, None, f"metadata has unknown fields {unknown}")
        try:
            meta = cls(**raw)
        except TypeError as e:
            raise CaptureError(where, None, f"metadata is missing fields ({e})") from None
        meta.check(where)
        return meta

    def check(self, where: str) -> None:
        def bad(msg: str) -> CaptureError:
            return CaptureError(where, None, f"metadata: {msg}")

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name, most in LIMITS.items():
            v = getattr(self, name)
            if not integer(v) or not 1 <= v <= most:
                raise bad(f"{name} must be a whole number from 1 to {most:,}, got {v!r}")
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
            raise bad(
                f"kv_lora_rank {self.kv_lora_rank} and qk_rope_head_dim {self.qk_rope_head_dim}: the verify kernel takes "
                f"MLA's {KV_LORA_RANK} and {QK_ROPE_HEAD_DIM} (q/k {KV_LORA_RANK + QK_ROPE_HEAD_DIM}, v {KV_LORA_RANK})"
            )
        if not integer(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise bad(f"tp_rank {self.tp_rank!r} must lie in [0, tp_size={self.tp_size})")
        if not _real(self.sm_scale) or not 0 < self.sm_scale <= MAX_SM_SCALE:
            raise bad(f"sm_scale must be a finite number > 0 and <= {MAX_SM_SCALE}, got {self.sm_scale!r:.40}")
        if not _real(self.logit_cap) or not 0 <= self.logit_cap <= MAX_LOGIT_CAP:
            raise bad(f"logit_cap must be a finite number from 0 (off) to {MAX_LOGIT_CAP:g}, got {self.logit_cap!r:.40}")
        if not isinstance(self.layer_ids, list) or not self.layer_ids or len(self.layer_ids) > MAX_LAYER_ID:
            raise bad(f"layer_ids must be a non-empty list of layer numbers, got {self.layer_ids!r:.80}")
        if not all(integer(x) and 0 <= x <= MAX_LAYER_ID for x in self.layer_ids):
            raise bad(f"layer_ids must be layer numbers from 0 to {MAX_LAYER_ID}, got {self.layer_ids!r:.80}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise bad(f"layer_ids has duplicates: {self.layer_ids}")
        if not isinstance(self.source, dict) or not isinstance(self.source.get("kind"), str):
            raise bad("source must be an object with a 'kind' ('sglang' or 'synthetic')")
        for name in ("model", "spec_algorithm", "reference", "sglang_version"):
            v = getattr(self, name)
            if not (isinstance(v, str) or (v is None and name == "sglang_version")) or len(v or "") > 1024:
                raise bad(f"{name} must be a string of at most 1024 characters, got {type(v).__name__}")
        for name in ("tree_budget", "num_draft_tokens"):
            v = getattr(self, name)
            if v is not None and (not integer(v) or not 0 <= v <= 1 << 20):
                raise bad(f"{name} must be a whole number >= 0 or null, got {v!r}")


KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64  # the MLA widths of every model kdtree serves, and the kernel's
MAX_LAYER_ID = 4096
# the largest value of each size in a capture's metadata: SGLang's slots are int32; pages, heads and ranks far
# past any model's
LIMITS = {
    "num_heads": 1024,
    "pool_size": 2**31 - 1,
    "page_size": 4096,
    "kv_lora_rank": 1 << 16,
    "qk_rope_head_dim": 1 << 16,
    "tp_size": 1024,
}
MAX_POOL_BYTES = 512 << 20  # Capture.pool's default bound (KDTREE_MAX_POOL_BYTES)
# past these no fp32 attention holds its logits (layer.scaling is ~0.07-0.15, caps ~30-50 where used): a value
# beyond them is bad input, not a kernel's mismatch
MAX_SM_SCALE, MAX_LOGIT_CAP = 16.0, 1e4


POOL_SLACK = 1024


def _max_pool_bytes() -> int:
    raw = os.environ.get("KDTREE_MAX_POOL_BYTES", "")
    if not raw:
        return MAX_POOL_BYTES
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 15:
        raise BadInput(f"KDTREE_MAX_POOL_BYTES={raw[:40]!r}: expected a whole number of bytes below 10^15")
    return int(raw)


def _real(v) -> bool:
    """A JSON number that is a finite float (a 400-digit integer is none: math.isfinite would overflow)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class _Tensors:
    """Name -> tensor, read on first use from an open safetensors file (memory-mapped) or a dict."""

    def __init__(self, handle=None, tensors: Mapping[str, torch.Tensor] | None = None):
        self._handle = handle
        self._cache: dict[str, torch.Tensor] = dict(tensors or {})
        self.names = set(handle.keys()) if handle is not None else set(self._cache)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            self._cache[name] = self._handle.get_tensor(name)
        return self._cache[name]

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype name, shape) without reading the data."""
        if self._handle is not None and name not in self._cache:
            sl = self._handle.get_slice(name)
            return sl.get_dtype(), tuple(sl.get_shape())
        t = self._cache[name]
        return _ST_DTYPES_INV[t.dtype], tuple(t.shape)


_ST_DTYPES_INV = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
}


@dataclass
class Layer:
    """One layer's tensors (read lazily)."""

    capture: "Capture"
    layer_id: int

    def _get(self, name: str) -> torch.Tensor | None:
        key = layer_key(self.layer_id, name)
        return self.capture._tensors.get(key) if key in self.capture._tensors else None

    @property
    def q(self) -> torch.Tensor:
        return self._get("q")

    @property
    def k(self) -> torch.Tensor:
        return self._get("k")

    @property
    def v(self) -> torch.Tensor:
        v = self._get("v")
        return v if v is not None else self.k[..., : self.capture.meta.v_head_dim]

    @property
    def o(self) -> torch.Tensor:
        """The output the capture's reference produced: CaptureError on first read if it holds a NaN or an inf (a
        reference that is no reference; checked here, not at load, so opening a capture reads no output)."""
        return self._checked("o")

    @property
    def lse(self) -> torch.Tensor | None:
        return self._checked("lse")

    def _checked(self, name: str) -> torch.Tensor | None:
        t = self._get(name)
        key = layer_key(self.layer_id, name)
        if t is not None and key not in self.capture._finite:
            check_finite(self.capture, self.layer_id, name, t)
            self.capture._finite.add(key)
        return t

    @property
    def kv_buffer_rows(self) -> torch.Tensor:
        """[R, 1, 576] pool rows at `capture.kv_buffer_slots`."""
        return self._get("kv_buffer")


class Capture:
    """A validated TARGET_VERIFY capture. Build with `load()` or `Capture.from_tensors()`."""

    def __init__(self, meta: CaptureMeta, tensors: _Tensors, path: Path | None = None):
        self.meta = meta
        self._tensors = tensors
        self.path = path
        self._finite: set[str] = set()  # tensors found finite on first read (Layer.o, Layer.lse)

    # ----- construction -------------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, meta: CaptureMeta, tensors: Mapping[str, torch.Tensor], *, validate: bool = True) -> "Capture":
        cap = cls(meta, _Tensors(tensors={k: v.contiguous() for k, v in tensors.items()}))
        if validate:
            validate_capture(cap)
        return cap

    def tensor_dict(self) -> dict[str, torch.Tensor]:
        """Every stored tensor, read into memory."""
        return {name: self._tensors.get(name) for name in sorted(self._tensors.names)}

    @property
    def where(self) -> str:
        return str(self.path) if self.path is not None else "<capture>"

    # ----- raw SGLang tensors (names as in docs/capture-format.md) --------------------------------
    def _raw(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name) if name in self._tensors else None

    @property
    def qo_indptr(self) -> torch.Tensor:
        """[bs+1] query offsets (int32 in SGLang)"""
        return self._raw("qo_indptr")

    @property
    def kv_indptr(self) -> torch.Tensor:
        """[bs+1] cumsum of prefix lengths (committed tokens only)"""
        return self._raw("kv_indptr")

    @property
    def kv_indices(self) -> torch.Tensor:
        """[kv_indptr[bs]] pool slots of the prefixes only"""
        return self._raw("kv_indices")

    @property
    def out_cache_loc(self) -> torch.Tensor:
        """[T] pool slots holding the draft tokens' k"""
        return self._raw("out_cache_loc")

    @property
    def custom_mask(self) -> torch.Tensor:
        """flat bool/uint8; per request row-major [N, prefix_len + N]"""
        return self._raw("custom_mask")

    @property
    def mask_indptr(self) -> torch.Tensor:
        """[bs+1] start of each request's mask block"""
        return self._raw("mask_indptr")

    @property
    def seq_lens(self) -> torch.Tensor:
        """[bs] prefix lengths"""
        return self._raw("seq_lens")

    @property
    def positions(self) -> torch.Tensor | None:
        """[T] rotary positions = prefix_len + depth (optional)"""
        return self._raw("positions")

    @property
    def kv_buffer_slots(self) -> torch.Tensor:
        """[R] sorted slot ids of the stored pool rows"""
        return self._raw(POOL_SLOTS)

    def layer(self, layer_id: int) -> Layer:
        if layer_id not in self.meta.layer_ids:
            raise KeyError(f"{self.where}: no layer {layer_id}; layers: {self.meta.layer_ids}")
        return Layer(self, layer_id)

    # ----- derived per-request facts -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.numel()) - 1

    @cached_property
    def prefix_lens(self) -> torch.Tensor:
        return (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()

    @cached_property
    def num_draft(self) -> torch.Tensor:
        """N per request (SGLang uses one N for the whole batch; the format allows any)."""
        return (self.qo_indptr[1:] - self.qo_indptr[:-1]).long()

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    def prefix_slots(self, b: int) -> torch.Tensor:
        return self.kv_indices[int(self.kv_indptr[b]) : int(self.kv_indptr[b + 1])]

    def draft_slots(self, b: int) -> torch.Tensor:
        return self.out_cache_loc[int(self.qo_indptr[b]) : int(self.qo_indptr[b + 1])]

    def mask_rows(self, b: int) -> torch.Tensor:
        """Request b's custom mask as SGLang lays it out: [N, prefix_len + N] (row stride prefix_len + N)."""
        p, n = int(self.prefix_lens[b]), int(self.num_draft[b])
        start = int(self.mask_indptr[b])
        return self.custom_mask[start : start + n * (p + n)].view(n, p + n)

    def tree_block(self, b: int) -> torch.Tensor:
        """[N, N] bool: the draft-to-draft part of request b's mask."""
        return self.mask_rows(b)[:, int(self.prefix_lens[b]) :].bool()

    def parents(self, b: int):
        return parents_from_mask(self.tree_block(b).numpy())

    def depths(self, b: int):
        return tree_depths(self.parents(b))

    # ----- the pool -----------------------------------------------------------------------------
    def pool_rows(self) -> int:
        """Rows of the rebuilt pool: SGLang's numbering up to the highest stored slot, plus POOL_SLACK NaN rows (a
        read just past the highest slot shows as NaN too), never past pool_size + page_size. Not pool_size itself:
        a server's pool of 262,144 slots whose step reads 600 would cost 300 MB a layer, and a small file could
        claim any pool_size."""
        m = self.meta
        top = int(self.kv_buffer_slots.max()) + 1 if self.kv_buffer_slots.numel() else 1
        return min(m.pool_size + m.page_size, top + POOL_SLACK)

    def pool(self, layer_id: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """kv_buffer as SGLang had it, [pool_rows(), 1, 576] bf16 with SGLang's slot numbering; slots the step
        does not reference are NaN, so a kernel that reads a wrong slot shows it. CaptureError where those rows
        would pass KDTREE_MAX_POOL_BYTES (default 512 MiB)."""
        m = self.meta
        rows, limit = self.pool_rows(), _max_pool_bytes()
        top = int(self.kv_buffer_slots.max()) if self.kv_buffer_slots.numel() else 0
        if rows * m.head_dim * 2 > limit:
            raise CaptureError(
                self.where,
                POOL_SLOTS,
                f"slot {top:,} makes a pool of {rows * m.head_dim * 2:,} B, more than "
                f"KDTREE_MAX_POOL_BYTES={limit:,} (raise it to diff this capture)",
            )
        try:
            buf = torch.full((rows, 1, m.head_dim), float("nan"), dtype=torch.bfloat16, device=device)
        except (RuntimeError, MemoryError) as e:  # torch's out-of-memory, on the host or the GPU
            raise CaptureError(self.where, POOL_SLOTS, f"slot {top:,} needs a pool of {rows * m.head_dim * 2:,} B: {e}") from None
        buf[self.kv_buffer_slots.to(device)] = self.layer(layer_id).kv_buffer_rows.to(device)
        return buf

    # ----- batch surgery (used by tests and notebooks) ------------------------------------------
    def select(self, requests: list[int]) -> "Capture":
        """A capture of just these requests (same pool numbering)."""
        return select_requests(self, requests)

    def __repr__(self) -> str:
        m = self.meta
        return (
            f"Capture({self.where}, bs={self.batch_size}, N={sorted(set(self.num_draft.tolist()))}, H={m.num_heads}, "
            f"layers={m.layer_ids}, source={m.source.get('kind')})"
        )


def header_json(meta: CaptureMeta, version: int = FORMAT_VERSION) -> str:
    """The file's metadata: format name and version, and the capture's CaptureMeta."""
    return json.dumps({"format": FORMAT_NAME, "format_version": version, "meta": dataclasses.asdict(meta)}, sort_keys=True)


# ----- I/O ----------------------------------------------------------------------------------------
def _safe_open(path: Path):
    """safetensors' memory-mapped reader. It takes only UTF-8 path strings: a file whose name is other bytes (a
    valid capture all the same) is opened here and handed over as /proc/self/fd/N, the same file by a UTF-8 name."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if not os.path.exists(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOENT, "its name is not UTF-8, and this system has no /proc to reach it otherwise")
            return safe_open(f"/proc/self/fd/{fd}", framework="pt")
        finally:
            os.close(fd)  # the mapping keeps the file
    return safe_open(str(path), framework="pt")


def load(path: str | os.PathLike, *, validate: bool = True) -> Capture:
    """Open a capture (memory-mapped), check it, and return it. Raises CaptureError, never writes."""
    path = Path(path)
    if not path.is_file():
        raise CaptureError(path, None, "not a regular file" if path.exists() else "no such file")
    try:
        handle = _safe_open(path)
        header = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CaptureError(path, None, f"not a readable safetensors file ({e}); truncated or not a capture?") from None
    try:
        head = parse_json(header["kdtree"])
        if not isinstance(head, dict):
            raise ValueError
    except (KeyError, ValueError):
        raise CaptureError(path, None, "not a kdtree capture (no JSON object under safetensors metadata key 'kdtree')") from None
    if head.get("format") != FORMAT_NAME:
        raise CaptureError(path, None, f"not a kdtree capture (format is {head.get('format')!r}, expected {FORMAT_NAME!r})")
    version = head.get("format_version")
    if version != FORMAT_VERSION:
        raise CaptureError(path, None, f"unknown format version {version!r}; this kdtree reads version {FORMAT_VERSION}")
    if not isinstance(head.get("meta"), dict):
        raise CaptureError(path, None, "metadata has no 'meta' object")
    meta = CaptureMeta.from_dict(head["meta"], str(path))
    cap = Capture(meta, _Tensors(handle=handle), path=path)
    if validate:
        validate_capture(cap)
    return cap


def capture_files(where: str | os.PathLike) -> list[Path]:
    """A capture file as given, or the capture files (*.safetensors) of a directory, sorted; BadInput naming
    the path when it does not exist or the directory holds none."""
    p = Path(where).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.safetensors"))
        if not found:
            raise BadInput(f"{p}: a directory with no capture files (*.safetensors)")
        return found
    if not p.exists():
        raise BadInput(f"{p}: no such file or directory")
    return [p]


def save(capture: Capture, path: str | os.PathLike, *, private: bool = False) -> Path:
    """Write atomically (`kdtree.files.atomic_path`): the file gets the mode a plain open() would give it, or,
    `private`, 0600 (owner only: a server's captures hold activations derived from its users' prompts)."""
    path = Path(path)
    # one metadata key: safetensors does not keep the order of several, and files must be reproducible
    metadata = {"kdtree": header_json(capture.meta)}
    with atomic_path(path, private=private) as tmp:
        try:
            save_file(capture.tensor_dict(), str(tmp), metadata=metadata)
        except SafetensorError as e:  # its I/O errors (a full disk) are its own type: an OSError naming the file
            raise OSError(errno.EIO, f"cannot write ({e})", str(path)) from e
    return path
