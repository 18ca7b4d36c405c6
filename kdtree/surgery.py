"""Transformations of a capture that must not change attention: take a sub-batch, relabel pool slots."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kdtree.format import POOL_SLOTS, layer_key

if TYPE_CHECKING:
    from kdtree.capture import Capture


def _indptr(lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.long).cumsum(0).to(dtype)


def _pool_rows(cap: Capture, lid: int, slots: torch.Tensor) -> torch.Tensor:
    pos = torch.searchsorted(cap.kv_buffer_slots.long(), slots)
    return cap.layer(lid).kv_buffer_rows[pos]


def select_requests(cap: Capture, requests: list[int]) -> Capture:
    """A valid capture holding only `requests` (in that order), with the original slot numbering."""
    if not requests:
        raise ValueError("select at least one request")
    for b in requests:
        if not 0 <= b < cap.batch_size:
            raise IndexError(f"request {b} out of range [0, {cap.batch_size})")
    qo, kvp = cap.qo_indptr, cap.kv_indptr
    tok = torch.cat([torch.arange(int(qo[b]), int(qo[b + 1])) for b in requests])
    t: dict[str, torch.Tensor] = {
        "qo_indptr": _indptr([int(cap.num_draft[b]) for b in requests], qo.dtype),
        "kv_indptr": _indptr([int(cap.prefix_lens[b]) for b in requests], kvp.dtype),
        "kv_indices": torch.cat([cap.prefix_slots(b) for b in requests]),
        "out_cache_loc": cap.out_cache_loc[tok],
        "custom_mask": torch.cat([cap.mask_rows(b).reshape(-1) for b in requests]),
        "seq_lens": cap.seq_lens[requests],
    }
    t["mask_indptr"] = _indptr([cap.mask_rows(b).numel() for b in requests], cap.mask_indptr.dtype)
    if cap.positions is not None:
        t["positions"] = cap.positions[tok]
    slots = torch.unique(torch.cat([t["kv_indices"].long(), t["out_cache_loc"].long()]))
    t[POOL_SLOTS] = slots.to(cap.kv_buffer_slots.dtype)
    for lid in cap.meta.layer_ids:
        layer = cap.layer(lid)
        for name in ("q", "k", "v", "o", "lse"):
            if layer_key(lid, name) in cap._tensors:
                t[layer_key(lid, name)] = getattr(layer, name)[tok]
        t[layer_key(lid, "kv_buffer")] = _pool_rows(cap, lid, slots)
    meta = dataclasses.replace(cap.meta, source={**cap.meta.source, "selected_requests": list(requests)})
    return type(cap).from_tensors(meta, t)


def relabel_slots(cap: Capture, new_slot_of: torch.Tensor) -> Capture:
    """Move every stored row to `new_slot_of[old_slot]` (a permutation of the pool that keeps slot 0)."""
    new_slot_of = new_slot_of.long()
    t = cap.tensor_dict()
    for name in ("kv_indices", "out_cache_loc"):
        t[name] = new_slot_of[t[name].long()].to(t[name].dtype)
    new_slots = new_slot_of[cap.kv_buffer_slots.long()]
    order = torch.argsort(new_slots)
    t[POOL_SLOTS] = new_slots[order].to(cap.kv_buffer_slots.dtype)
    for lid in cap.meta.layer_ids:
        t[layer_key(lid, "kv_buffer")] = t[layer_key(lid, "kv_buffer")][order]
    return type(cap).from_tensors(cap.meta, t)
