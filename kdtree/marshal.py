"""SGLang's TARGET_VERIFY tensors -> the verify kernel's arguments, with every step kept for inspection.

The kernel reads **all** keys from the pool, so per request it needs the combined slot list
`kv_indices[kv_indptr[b]:kv_indptr[b+1]] ++ out_cache_loc[qo_indptr[b]:qo_indptr[b+1]]`, and the draft
block of the custom mask, whose rows have stride `prefix_len + N`, packed to bits: `tree_mask[t, w]` bit
`j % 32` of word `j // 32` says whether token t (a draft node) sees draft node j of its request.

`FAULTS` reproduces the two historical marshaling bugs so the harness can be shown to catch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kdtree.capture import Capture
from kdtree.errors import BadInput

FAULTS = {
    "prefix-only-kv": "treat kv_indices (prefix only) as all keys: the draft keys at out_cache_loc are never read",
    "prefix-stride": "read the mask with row stride prefix_len instead of prefix_len + N",
}


@dataclass
class RequestSteps:
    """What marshaling did for one request (for notebooks and error messages)."""

    request: int
    prefix_len: int
    num_draft: int
    prefix_slots: torch.Tensor  # kv_indices slice
    draft_slots: torch.Tensor  # out_cache_loc slice
    combined_slots: torch.Tensor  # what the kernel walks
    mask_start: int  # mask_indptr[b]
    mask_row_stride: int  # prefix_len + N (or the faulty value)
    tree_block: torch.Tensor  # [N, N] bool as extracted


@dataclass
class VerifyArgs:
    """The kernel's arguments. Index tensors are int32 (a pool of < 2^31 slots)."""

    qo_indptr: torch.Tensor  # [bs+1]
    combined_kv_indptr: torch.Tensor  # [bs+1], cumsum(prefix_len + N)
    combined_kv_indices: torch.Tensor  # [sum(prefix_len + N)]
    prefix_lens: torch.Tensor  # [bs]: where the draft keys start in each request's combined list
    tree_mask: torch.Tensor  # [T, W] int32, W = ceil(max N / 32)
    max_num_draft: int
    max_kv_len: int
    sm_scale: float
    logit_cap: float
    fault: str | None = None
    steps: list[RequestSteps] = field(default_factory=list, repr=False)

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    def to(self, device) -> "VerifyArgs":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items() if k != "steps"}
        return VerifyArgs(**moved, steps=self.steps)


def pack_bits(block: np.ndarray, words: int) -> np.ndarray:
    """[rows, n] bool -> [rows, words] int32, bit j%32 of word j//32 (little-endian, as FlashInfer packs)."""
    rows, n = block.shape
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :n] = block
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_bits: [rows, W] int32 -> [rows, n] bool."""
    w = words.numpy().astype("<i4").view(np.uint8)
    return torch.from_numpy(np.unpackbits(w, axis=1, bitorder="little")[:, :n].astype(bool))


def marshal(cap: Capture, fault: str | None = None) -> VerifyArgs:
    """Build the kernel arguments from the raw capture, keeping every intermediate in `.steps`."""
    if fault is not None and fault not in FAULTS:
        raise BadInput(f"unknown fault {fault!r}; expected one of {', '.join(FAULTS)}")
    bs = cap.batch_size
    n_max = int(cap.num_draft.max())
    words = (n_max + 31) // 32
    tree_mask = np.zeros((cap.num_tokens, words), dtype=np.int32)
    mask = cap.custom_mask
    steps: list[RequestSteps] = []
    combined: list[torch.Tensor] = []
    lens: list[int] = []
    for b in range(bs):
        p, n = int(cap.prefix_lens[b]), int(cap.num_draft[b])
        prefix_slots, draft_slots = cap.prefix_slots(b), cap.draft_slots(b)
        slots = prefix_slots if fault == "prefix-only-kv" else torch.cat([prefix_slots, draft_slots])
        stride = p if fault == "prefix-stride" else p + n
        start = int(cap.mask_indptr[b])
        flat = start + torch.arange(n)[:, None] * stride + p + torch.arange(n)[None, :]
        block = mask[flat].bool()
        q0 = int(cap.qo_indptr[b])
        tree_mask[q0 : q0 + n] = pack_bits(block.numpy(), words)
        combined.append(slots)
        lens.append(slots.numel())
        steps.append(RequestSteps(b, p, n, prefix_slots, draft_slots, slots, start, stride, block))
    indptr = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
    return VerifyArgs(
        qo_indptr=cap.qo_indptr.to(torch.int32),
        combined_kv_indptr=indptr.to(torch.int32),
        combined_kv_indices=torch.cat(combined).to(torch.int32),
        prefix_lens=cap.prefix_lens.to(torch.int32),
        tree_mask=torch.from_numpy(tree_mask),
        max_num_draft=n_max,
        max_kv_len=max(lens),
        sm_scale=float(cap.meta.sm_scale),
        logit_cap=float(cap.meta.logit_cap),
        fault=fault,
        steps=steps,
    )
