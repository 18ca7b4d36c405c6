"""What an implementation returns (`AttnOutput`) and the poisoned buffers it writes into: outputs are filled
with a NaN of a distinctive bit pattern before an implementation runs, so that elements it never wrote are
told apart from NaNs it computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

POISON_BITS = 0x7FA5  # a bf16 NaN no arithmetic produces (those are 0x7FC0 / 0xFFC0)


@dataclass
class AttnOutput:
    o: torch.Tensor  # [T, H, 512]
    lse: torch.Tensor | None  # [T, H], natural log


def poisoned(shape, device="cpu") -> torch.Tensor:
    """A bf16 output buffer every element of which is the poison pattern."""
    return torch.full(shape, POISON_BITS, dtype=torch.int16, device=device).view(torch.bfloat16)


def unwritten_mask(o: torch.Tensor) -> torch.Tensor:
    """Elements of `o` still holding the poison."""
    if o.dtype != torch.bfloat16:
        return torch.zeros(o.shape, dtype=torch.bool, device=o.device)
    return o.view(torch.int16) == POISON_BITS
