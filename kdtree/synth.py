"""Synthetic captures in exactly the capture format, deterministic for a seed.

Values have the structure real MLA attention has, because a kernel's bugs hide in flat random data:
- latents c_KV are RMS-normalised with a learned-looking per-channel gain and a few outlier channels;
- k_pe / q_pe are rotary-encoded at the real positions (prefix: 0..P-1, draft node: P + depth), with
  energy in the high-frequency pairs, so heads attend to nearby positions (recency);
- each query carries part of its own token's latent (heads that look at the current token);
- the first prefix token is an attention sink;
- `extreme_logits` multiplies the logits by 8 (rows dominated by one key, large maxima).
Heads mix these behaviours with per-head weights. `o`/`lse` come from the fp64 oracle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kdtree import __version__
from kdtree.capture import MAX_LAYER_ID, MAX_LOGIT_CAP, POOL_SLOTS, Capture, CaptureMeta, layer_key
from kdtree.errors import BadInput
from kdtree.presets import get_preset
from kdtree.reference import oracle
from kdtree.trees import TREE_KINDS, ancestor_mask, depths, make_tree

SPEC_ALGORITHM = {"ddtree": "DDTREE", "eagle": "EAGLE", "chain": "DFLASH", "star": "STAR", "random": "RANDOM"}
DEFAULT_TOPK = {"ddtree": 8, "eagle": 4}
DEFAULT_DEPTH = {"ddtree": 15, "eagle": 5}
LATENT, ROPE = 512, 64


# what a synthetic capture may ask for: past these the file, the mask or the oracle's work outgrows a workbench
MAX_BATCH, MAX_LAYERS, MAX_KEYS, MAX_MASK, MAX_POOL_SLOTS = 1024, 64, 1 << 21, 1 << 28, 1 << 24


@dataclass
class SynthSpec:
    """Parameters of one synthetic capture (all recorded in its metadata)."""

    preset: str = "kimi-k2-tp8"
    batch_size: int = 1
    prefix_lens: list[int] = field(default_factory=lambda: [1024])  # one per request, or one for all
    tree: str = "ddtree"
    num_draft_tokens: int | None = None  # N; for ddtree, budget + 1
    budget: int | None = None  # ddtree only
    topk: int | None = None
    max_depth: int | None = None  # ddtree: block size - 1; eagle: steps
    layers: list[int] = field(default_factory=lambda: [0])
    seed: int = 0
    pool_size: int | None = None  # default: referenced slots x 1.5 (at least + 1024)
    extreme_logits: bool = False
    logit_cap: float = 0.0

    def resolved(self) -> "SynthSpec":
        """Fill defaults and check the parameters; raises BadInput naming the bad one."""
        s = dataclasses.replace(self, prefix_lens=list(self.prefix_lens), layers=list(self.layers))
        get_preset(s.preset)
        if s.tree not in TREE_KINDS:
            raise BadInput(f"tree: unknown kind {s.tree!r}; expected one of {', '.join(TREE_KINDS)}")
        if not 1 <= s.batch_size <= MAX_BATCH:
            raise BadInput(f"batch_size must be >= 1 and at most {MAX_BATCH}, got {s.batch_size}")
        if len(s.prefix_lens) == 1:
            s.prefix_lens = s.prefix_lens * s.batch_size
        if len(s.prefix_lens) != s.batch_size:
            raise BadInput(
                f"prefix_lens: {len(s.prefix_lens)} values for batch_size {s.batch_size} (give one, or one per request)"
            )
        if any(p < 0 or p > 1 << 20 for p in s.prefix_lens):
            raise BadInput(f"prefix_lens must lie in [0, 2^20], got {s.prefix_lens}")
        if s.tree == "ddtree":
            if s.budget is None:
                s.budget = (s.num_draft_tokens - 1) if s.num_draft_tokens else 64
            if not 1 <= s.budget <= 4096:
                raise BadInput(f"budget must lie in [1, 4096], got {s.budget}")
            if s.num_draft_tokens not in (None, s.budget + 1):
                raise BadInput(f"ddtree: num_draft_tokens must be budget + 1 = {s.budget + 1}")
            s.num_draft_tokens = s.budget + 1
        elif s.budget is not None:
            raise BadInput("budget applies to --tree ddtree only; use num_draft_tokens")
        if s.num_draft_tokens is None:
            s.num_draft_tokens = {"eagle": 8, "chain": 16}.get(s.tree, 16)
        if not 1 <= s.num_draft_tokens <= 4097:
            raise BadInput(f"num_draft_tokens must lie in [1, 4097], got {s.num_draft_tokens}")
        s.topk = s.topk or DEFAULT_TOPK.get(s.tree, 0) or None
        s.max_depth = s.max_depth or DEFAULT_DEPTH.get(s.tree) or None
        if not s.layers or len(set(s.layers)) != len(s.layers) or min(s.layers) < 0 or max(s.layers) > MAX_LAYER_ID:
            raise BadInput(f"layers must be distinct layer numbers from 0 to {MAX_LAYER_ID}, got {s.layers!s:.80}")
        if len(s.layers) > MAX_LAYERS:
            raise BadInput(f"layers: {len(s.layers)} layers; a synthetic capture holds at most {MAX_LAYERS}")
        if not math.isfinite(s.logit_cap) or not 0 <= s.logit_cap <= MAX_LOGIT_CAP:
            raise BadInput(f"logit_cap must be a finite number from 0 (off) to {MAX_LOGIT_CAP:g}, got {s.logit_cap}")
        if not 0 <= s.seed < 2**32:
            raise BadInput(f"seed must lie in [0, 2^32), got {s.seed}")
        for name in ("topk", "max_depth"):
            if getattr(s, name) is not None and not 1 <= getattr(s, name) <= 64:
                raise BadInput(f"{name} must lie in [1, 64], got {getattr(s, name)}")
        n = s.num_draft_tokens
        if sum(p + n for p in s.prefix_lens) > MAX_KEYS or sum(n * (p + n) for p in s.prefix_lens) > MAX_MASK:
            raise BadInput(
                f"the batch reads {sum(p + n for p in s.prefix_lens):,} keys with a mask of "
                f"{sum(n * (p + n) for p in s.prefix_lens):,} bits: at most {MAX_KEYS:,} and {MAX_MASK:,} (the oracle's work)"
            )
        if s.pool_size is not None and not 1 <= s.pool_size <= MAX_POOL_SLOTS:
            raise BadInput(f"pool_size must lie in [1, {MAX_POOL_SLOTS:,}], got {s.pool_size}")
        return s


def _generator(*key) -> torch.Generator:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def churned_free_list(pool_size: int, rng: np.random.Generator) -> np.ndarray:
    """Slots 1..pool_size in the order a long-running allocator hands them out: runs of neighbouring
    slots (freed together) in shuffled order."""
    cuts = np.cumsum(rng.geometric(1 / 12, size=pool_size // 2 + 2))
    cuts = cuts[cuts < pool_size]
    runs = np.split(np.arange(1, pool_size + 1), cuts)
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order])


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [..., 64] by pos * theta^(-2i/64)."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = pos.double()[:, None] * freq[None, :]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(1)
    cos, sin = torch.cos(ang), torch.sin(ang)
    a, b = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.empty(x.shape, dtype=torch.float64)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out.float()


def _layer_values(spec: SynthSpec, lid: int, prefix_lens, trees, scale: float, theta: float, num_heads: int):
    """Per request: prefix keys [P, 576], draft keys [N, 576], queries [N, H, 576] (float32)."""
    g = _generator("layer", spec.seed, lid)
    H = num_heads
    gain = 1 + 0.25 * torch.randn(LATENT, generator=g).abs()
    outliers = torch.randperm(LATENT, generator=g)[:6]
    gain[outliers] *= 6 + 6 * torch.rand(6, generator=g)
    sink_dir = torch.randn(LATENT, generator=g)
    sink_dir /= sink_dir.norm()
    u = torch.randn(ROPE, generator=g)
    u[:4] *= 0.1  # energy in pairs 2..9: positional heads attend to the last few tokens
    u[20:] *= 0.1
    w_self = torch.rand(H, generator=g)
    w_rope = 5 + 6 * torch.rand(H, generator=g)
    w_sink = 1 + 4 * torch.rand(H, generator=g)
    u_h = u + 0.3 * torch.randn(H, ROPE, generator=g)
    boost = 8.0 if spec.extreme_logits else 1.0
    sink_strength = 12.0

    def latents(n: int) -> torch.Tensor:
        z = torch.randn(n, LATENT, generator=g)
        rms = torch.linalg.vector_norm(z, dim=1, keepdim=True).mul_(LATENT**-0.5)
        return z.div_(rms).mul_(gain)

    out = []
    for p, parents in zip(prefix_lens, trees):
        n = len(parents)
        depth = torch.from_numpy(depths(parents))
        c_pre, c_dr = latents(p), latents(n)
        if p > 0:
            c_pre[0] += sink_strength * sink_dir
        pos_pre, pos_dr = torch.arange(p), p + depth
        kpe_pre = _rope(u + 0.3 * torch.randn(p, ROPE, generator=g), pos_pre, theta)
        kpe_dr = _rope(u + 0.3 * torch.randn(n, ROPE, generator=g), pos_dr, theta)
        k_pre, k_dr = torch.cat([c_pre, kpe_pre], 1), torch.cat([c_dr, kpe_dr], 1)
        # queries: own-token content + sink direction + background, and rotary at the node's position
        c_sq = c_dr.pow(2).sum(1, keepdim=True)  # [n, 1]
        bg = 0.5 / (scale * gain.pow(2).sum().sqrt())
        q_lat = (
            (w_self[None, :, None] / (scale * c_sq[:, :, None])) * c_dr[:, None, :]
            + (w_sink[None, :, None] / (scale * sink_strength)) * sink_dir
            + bg * torch.randn(n, H, LATENT, generator=g)
        )
        r_h = w_rope / (scale * u.pow(2).sum())
        q_pe = _rope((r_h[:, None] * u_h)[None].expand(n, H, ROPE).contiguous(), pos_dr, theta)
        q = torch.cat([q_lat, q_pe], 2) * boost
        out.append((k_pre, k_dr, q))
    return out


REFERENCES = ("oracle", "sglang", "none")


def synthesize(spec: SynthSpec, *, device: str = "cpu", reference: bool | str = True) -> Capture:
    """Build a validated capture from the spec, with `o` from `reference`:

    "oracle" (or True): the fp64 oracle run on `device`, with its LSE; "sglang": SGLang's Triton kernel on
    the GPU, called as its backend does (no LSE: it does not return one); "none" (or False): zeros, for
    benchmarks, which need inputs only. meta.reference records which.
    """
    reference = {True: "oracle", False: "none"}.get(reference, reference)
    if reference not in REFERENCES:
        raise BadInput(f"reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
    s = spec.resolved()
    preset = get_preset(s.preset)
    rng = np.random.default_rng(s.seed)
    P = s.prefix_lens
    trees = [make_tree(s.tree, s.num_draft_tokens, rng, topk=s.topk or 8, max_depth=s.max_depth or 15) for _ in P]
    N = [len(t) for t in trees]
    T = sum(N)
    need = sum(P) + T
    pool_size = s.pool_size or need + max(1024, need // 2)
    if pool_size < need:
        raise BadInput(f"pool_size {pool_size} is smaller than the {need} slots this batch references")
    free = churned_free_list(pool_size, rng)
    prefix_slots = np.split(free[: sum(P)], np.cumsum(P)[:-1])
    out_cache_loc = free[sum(P) : need]

    t: dict[str, torch.Tensor] = {
        "qo_indptr": torch.tensor([0] + N).cumsum(0).to(torch.int32),
        "kv_indptr": torch.tensor([0] + P).cumsum(0).to(torch.int32),
        "kv_indices": torch.from_numpy(np.concatenate(prefix_slots).astype(np.int64)),
        "out_cache_loc": torch.from_numpy(out_cache_loc.astype(np.int64)),
        "seq_lens": torch.tensor(P, dtype=torch.int64),
        "mask_indptr": torch.tensor([0] + [n * (p + n) for p, n in zip(P, N)]).cumsum(0).to(torch.int64),
        "positions": torch.cat([p + torch.from_numpy(depths(tr)) for p, tr in zip(P, trees)]).to(torch.int64),
    }
    masks = []
    for p, tr in zip(P, trees):
        rows = np.ones((len(tr), p + len(tr)), dtype=bool)
        rows[:, p:] = ancestor_mask(tr)
        masks.append(torch.from_numpy(rows.reshape(-1)))
    t["custom_mask"] = torch.cat(masks)
    slots = torch.cat([t["kv_indices"], t["out_cache_loc"]])
    sorted_slots, order = torch.sort(slots)
    t[POOL_SLOTS] = sorted_slots
    for lid in s.layers:
        vals = _layer_values(s, lid, P, trees, preset.sm_scale, preset.rope_theta, preset.num_heads)
        k_pre = torch.cat([v[0] for v in vals]).to(torch.bfloat16)
        k_dr = torch.cat([v[1] for v in vals]).to(torch.bfloat16)
        t[layer_key(lid, "q")] = torch.cat([v[2] for v in vals]).to(torch.bfloat16)
        t[layer_key(lid, "k")] = k_dr[:, None, :]
        t[layer_key(lid, "kv_buffer")] = torch.cat([k_pre, k_dr])[order][:, None, :]
        t[layer_key(lid, "o")] = torch.zeros(T, preset.num_heads, LATENT, dtype=torch.bfloat16)
        t[layer_key(lid, "lse")] = torch.zeros(T, preset.num_heads, dtype=torch.float32)
    meta = CaptureMeta(
        num_heads=preset.num_heads,
        sm_scale=preset.sm_scale,
        layer_ids=s.layers,
        pool_size=pool_size,
        logit_cap=s.logit_cap,
        model=preset.model,
        tp_rank=0,
        tp_size=preset.tp_size,
        spec_algorithm=SPEC_ALGORITHM[s.tree],
        tree_budget=s.budget,
        num_draft_tokens=s.num_draft_tokens,
        source={"kind": "synthetic", "generator": "kdtree.synth", "kdtree_version": __version__, "spec": dataclasses.asdict(s)},
        reference={"oracle": "kdtree:oracle-fp64", "none": "none"}.get(reference, ""),
    )
    draft = Capture.from_tensors(meta, t, validate=False)
    if reference == "sglang":
        from kdtree import sglang

        fn, where = sglang.extend_attention()
        if fn is None or not torch.cuda.is_available():
            raise BadInput(f"--reference sglang needs a GPU and an importable SGLang: {where}")
        meta.reference = f"sglang:triton extend_attention_fwd from {where}"
        for lid in s.layers:
            t[layer_key(lid, "o")] = sglang.run(draft, lid).cpu()
            del t[layer_key(lid, "lse")]
    for lid in s.layers if reference == "oracle" else []:
        ref = oracle(draft, lid, device=device)
        t[layer_key(lid, "o")] = ref.o.to(torch.bfloat16).cpu()
        t[layer_key(lid, "lse")] = ref.lse.to(torch.float32).cpu()
    return Capture.from_tensors(meta, t)
