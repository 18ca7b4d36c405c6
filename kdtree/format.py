"""Capture format v1's names: the format's id and version, the tensors it holds, its error and layer keys
(docs/capture-format.md). Shared by the loader (`kdtree.capture`) and the checks (`kdtree.validate`)."""

from __future__ import annotations

import os

from kdtree.errors import BadInput

FORMAT_NAME = "kdtree-capture"
FORMAT_VERSION = 1

SHARED_TENSORS = ("qo_indptr", "kv_indptr", "kv_indices", "out_cache_loc", "custom_mask", "mask_indptr", "seq_lens")
OPTIONAL_SHARED_TENSORS = ("positions",)
POOL_SLOTS = "kv_buffer_slots"
LAYER_TENSORS = ("q", "k", "o", "kv_buffer")
OPTIONAL_LAYER_TENSORS = ("v", "lse")


class CaptureError(BadInput):
    """A capture that breaks a rule of the format: says which file, which tensor and which rule."""

    def __init__(self, where: str | os.PathLike | None, tensor: str | None, message: str):
        self.where, self.tensor, self.rule = (str(where) if where is not None else "<capture>"), tensor, message
        super().__init__(f"{self.where}: {tensor}: {message}" if tensor else f"{self.where}: {message}")


def layer_key(layer_id: int, name: str) -> str:
    return f"layers.{layer_id}.{name}"
