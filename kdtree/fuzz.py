"""Seeded fuzz batches for the kernel: every tree kind, N 1..1025, prefixes 0..131072, batch 1..64,
H 8/16/64/128, scattered pools, extreme logits. `fuzz_spec(seed)` is deterministic."""

from __future__ import annotations

import numpy as np

from kdtree.synth import SynthSpec

HEADS_PRESET = {8: "kimi-k2-tp8", 16: "deepseek-v3-tp8", 64: "kimi-k2-dp", 128: "deepseek-v3-dp"}
KINDS = ("chain", "star", "ddtree", "random", "eagle")
EDGE_N = (1, 2, 16, 31, 32, 33, 64, 65, 129, 257, 1025)
EDGE_PREFIX = (0, 1, 2, 31, 32, 33, 63, 64, 65, 4095, 4096, 131072)
MAX_KEYS = 140_000  # sum of prefix + N over the batch
MAX_ROWS = 100_000  # sum of N * H over the batch
MAX_WORK = 2e9  # sum of rows x keys (the fp64 oracle's cost)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


def fuzz_spec(seed: int) -> SynthSpec:
    rng = np.random.default_rng([7, seed])
    kind = KINDS[seed % len(KINDS)]
    H = [8, 16, 64, 128][rng.integers(0, 4)]
    n = int(rng.choice(EDGE_N)) if rng.random() < 0.3 else _log_uniform(rng, 1, 1025)
    if kind == "eagle":
        n = min(n, 64)
    if kind == "ddtree":
        n = max(n, 2)
    bs = _log_uniform(rng, 1, 64)
    prefixes = []
    for _ in range(bs):
        prefixes.append(int(rng.choice(EDGE_PREFIX)) if rng.random() < 0.3 else _log_uniform(rng, 1, 131072) - 1)
    # pin the extremes so every run covers them
    if seed % 40 == 1:
        bs, H, n, prefixes = 64, 8, min(n, 65), [int(x) for x in rng.integers(0, 300, 64)]
    elif seed % 40 == 2:
        n, prefixes = 1025, prefixes[:1]
        kind = "random"
    elif seed % 40 == 3:
        prefixes = [131072]
    # shrink the batch until it fits the budgets (keeps at least one request)
    while len(prefixes) > 1 and (
        sum(prefixes) + n * len(prefixes) > MAX_KEYS
        or n * H * len(prefixes) > MAX_ROWS
        or sum((p + n) * n * H for p in prefixes) > MAX_WORK
    ):
        prefixes.pop()
    p0 = prefixes[0]
    while (p0 + n) * n * H > MAX_WORK or n * H > MAX_ROWS:
        if p0 > 1024:
            p0 //= 2
        else:
            n = max(1, n // 2)
    prefixes[0] = min(p0, MAX_KEYS - n)
    spec = SynthSpec(
        preset=HEADS_PRESET[H],
        batch_size=len(prefixes),
        prefix_lens=prefixes,
        tree=kind,
        budget=(n - 1) if kind == "ddtree" else None,
        num_draft_tokens=None if kind == "ddtree" else n,
        seed=seed,
        extreme_logits=bool(rng.random() < 0.2),
    )
    return spec.resolved()
