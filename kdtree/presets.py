"""Model presets for synthetic captures: heads per rank and the layer's softmax scale.

Scales are `192**-0.5 * mscale**2` with `mscale = 0.1 * ln(yarn_factor) + 1`, as SGLang's layer holds them
(Kimi-K2 family: yarn factor 32; DeepSeek-V3: 40). Heads per rank = total heads / attention-TP size.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdtree.errors import BadInput


@dataclass(frozen=True)
class ModelPreset:
    name: str
    model: str
    num_heads: int  # per rank
    total_heads: int
    sm_scale: float
    tp_size: int
    attention: str  # "tp" or "dp"
    num_layers: int = 61
    rope_theta: float = 50000.0


PRESETS = {
    p.name: p
    for p in (
        ModelPreset("kimi-k2-tp8", "Kimi-K2.x", 8, 64, 0.130861, 8, "tp"),
        ModelPreset("deepseek-v3-tp8", "DeepSeek-V3", 16, 128, 0.135234, 8, "tp", rope_theta=10000.0),
        ModelPreset("kimi-k2-dp", "Kimi-K2.x", 64, 64, 0.130861, 8, "dp"),
        ModelPreset("deepseek-v3-dp", "DeepSeek-V3", 128, 128, 0.135234, 8, "dp", rope_theta=10000.0),
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise BadInput(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}") from None
