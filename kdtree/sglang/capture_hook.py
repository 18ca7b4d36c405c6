"""Capture mode: one layer of one verify step, with the output SGLang served, written as a capture format v1
file (`docs/capture-format.md`), validated and atomically, within a file count and a byte budget.

Nothing here raises into the server: a file that cannot be built, validated or written is logged once, and
capture stops (`CaptureWriter.enabled`), so a full disk or an unwritable directory never stops serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kdtree.capture import Capture, CaptureError, CaptureMeta, layer_key, save
from kdtree.sglang import log
from kdtree.sglang.verify import VerifyBatch


def full_mask(batch: VerifyBatch, prefix_lens: list[int]) -> torch.Tensor:
    """The flat custom mask ([N, prefix_len + N] rows per request) on the host; SGLang's when it passed one,
    else the causal chain it means by none."""
    end = int(batch.mask_indptr[batch.batch_size])
    if batch.custom_mask is not None:
        return batch.custom_mask[:end].cpu().bool()
    n = batch.num_draft
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return torch.cat([torch.cat([torch.ones(n, p, dtype=torch.bool), chain], 1).flatten() for p in prefix_lens])


def capture_tensors(batch: VerifyBatch, layer_id: int, q: torch.Tensor, o: torch.Tensor, kv_buffer: torch.Tensor) -> dict:
    """The capture's tensors on the host: SGLang's metadata, this layer's q and served o [T, H, *], and the
    pool rows the step reads. The draft keys `k` are read back from the pool at `out_cache_loc` (SGLang wrote
    them there before attention; the kit's modules pass k=None)."""
    bs, T = batch.batch_size, batch.num_tokens
    prefix = batch.prefix_lens()
    kv_indices = batch.kv_indices[: sum(prefix)].long()
    out_cache_loc = batch.out_cache_loc[:T].long()
    slots = torch.unique(torch.cat([kv_indices, out_cache_loc]))
    heads = q.shape[1]
    return {
        "qo_indptr": batch.qo_indptr[: bs + 1].cpu().to(torch.int32),
        "kv_indptr": batch.kv_indptr[: bs + 1].cpu().to(torch.int32),
        "kv_indices": kv_indices.cpu(),
        "out_cache_loc": out_cache_loc.cpu(),
        "custom_mask": full_mask(batch, prefix),
        "mask_indptr": batch.mask_indptr[: bs + 1].cpu().long(),
        "seq_lens": torch.tensor(prefix, dtype=torch.int32),
        "kv_buffer_slots": slots.cpu(),
        layer_key(layer_id, "q"): q[:T].reshape(T, heads, -1).cpu(),
        layer_key(layer_id, "k"): kv_buffer[out_cache_loc].reshape(T, 1, -1).cpu(),
        layer_key(layer_id, "o"): o[:T].reshape(T, heads, -1).cpu(),
        layer_key(layer_id, "kv_buffer"): kv_buffer[slots].reshape(len(slots), 1, -1).cpu(),
    }


@dataclass
class CaptureWriter:
    """Writes capture files into `directory` until `max_files` files or `max_bytes` bytes are written."""

    directory: Path
    max_files: int
    max_bytes: int
    files: int = 0
    bytes: int = 0
    enabled: bool = True
    written: list[Path] = field(default_factory=list)

    def _stop(self, key: str, why: str) -> None:
        self.enabled = False
        log.once(f"capture:{key}", f"capture stopped: {why}; serving goes on")

    def write(self, name: str, meta: CaptureMeta, tensors: dict) -> Path | None:
        """Validate and write `directory/name`; None (and capture stopped, logged once) when it cannot."""
        if not self.enabled:
            return None
        if self.files >= self.max_files:
            self._stop("files", f"{self.files} files written to {self.directory}, the KDTREE_CAPTURE_MAX_FILES budget")
            return None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.bytes + size > self.max_bytes:
            self._stop(
                "bytes",
                f"the next file ({size:,} B) would take {self.directory} past KDTREE_CAPTURE_MAX_BYTES "
                f"({self.bytes:,} of {self.max_bytes:,} B written)",
            )
            return None
        path = self.directory / name
        try:
            cap = Capture.from_tensors(meta, tensors)
            self.directory.mkdir(parents=True, exist_ok=True)
            save(cap, path, private=True)  # 0600: activations derived from users' prompts
        except CaptureError as e:
            self._stop("invalid", f"the step did not make a valid capture ({e})")
            return None
        except OSError as e:
            self._stop("os", f"cannot write {path} ({type(e).__name__}: {e})")
            return None
        self.files += 1
        self.bytes += path.stat().st_size
        self.written.append(path)
        log.once("capture:first", f"capture: writing to {self.directory} ({path.name} first)", logging.INFO)
        return path
