"""Capture mode: one layer of one verify step, with the output SGLang served, written as a capture format v1
file (`docs/capture-format.md`), validated and atomically, within a file count and a byte budget.

Nothing here raises into the server: a file that cannot be built, validated or written is logged once, and
capture stops (`CaptureWriter.enabled`), so a full disk or an unwritable directory never stops serving.
"""

from __future__ import annotations

import logging
import os
import time
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


def run_tag() -> str:
    """What makes this process's capture files its own: the start time and the process id (a restarted server, a
    second DP replica or TP rank writing into the same folder never replaces another's file)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


@dataclass
class CaptureWriter:
    """Writes capture files into `directory` until it holds `max_files` files or `max_bytes` bytes, counting the
    capture files already there (another run's, another process's). Each name gets this writer's `run` tag."""

    directory: Path
    max_files: int
    max_bytes: int
    files: int = 0
    bytes: int = 0
    enabled: bool = True
    written: list[Path] = field(default_factory=list)
    run: str = field(default_factory=run_tag)
    counted: bool = False

    def _stop(self, key: str, why: str) -> None:
        self.enabled = False
        log.once(f"capture:{key}", f"capture stopped: {why}; serving goes on")

    def _count_existing(self) -> None:
        """The capture files already in the folder count toward both budgets (looked at up to the file budget)."""
        self.counted = True
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False):
                        self.files += 1
                        self.bytes += entry.stat(follow_symlinks=False).st_size
                        if self.files > self.max_files:
                            break
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:  # the write below says why, once
            log.once("capture:scan", f"capture: cannot list {self.directory} ({type(e).__name__}: {e})")
            return
        if self.files:
            log.once(
                "capture:existing",
                f"capture: {self.files} files ({self.bytes:,} B) already in {self.directory} count toward the budgets",
                logging.INFO,
            )

    def write(self, name: str, meta: CaptureMeta, tensors: dict) -> Path | None:
        """Validate and write `directory/name` with the run tag before its suffix (`step000005-L0-tp0` becomes
        `step000005-L0-tp0-20261207T231500-4242.safetensors`); None (and capture stopped, said once) when it
        cannot. Nothing raises into the server: any failure to build or write a file stops capture."""
        if not self.enabled:
            return None
        if not self.counted:
            self._count_existing()
        if self.files >= self.max_files:
            self._stop("files", f"{self.directory} holds {self.files} capture files, the KDTREE_CAPTURE_MAX_FILES budget")
            return None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.bytes + size > self.max_bytes:
            self._stop(
                "bytes",
                f"the next file ({size:,} B) would take {self.directory} past KDTREE_CAPTURE_MAX_BYTES "
                f"({self.bytes:,} of {self.max_bytes:,} B there)",
            )
            return None
        stem = name.removesuffix(".safetensors")
        path = self.directory / f"{stem}-{self.run}.safetensors"
        try:
            cap = Capture.from_tensors(meta, tensors)
            save(cap, path, private=True)  # makes the folder  # 0600: activations derived from users' prompts
            written = path.stat().st_size
        except CaptureError as e:
            self._stop("invalid", f"the step did not make a valid capture ({e})")
            return None
        except Exception as e:  # noqa: BLE001 - a full disk is an OSError or safetensors' own error: either stops capture
            self._stop("write", f"cannot write {path} ({type(e).__name__}: {e})")
            return None
        self.files += 1
        self.bytes += written
        self.written.append(path)
        log.once("capture:first", f"capture: writing to {self.directory} ({path.name} first)", logging.INFO)
        return path
