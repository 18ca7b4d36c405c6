"""The graph-shaped planner (torch ops, fixed shapes) against the host planner: the same arrays on the shipped
captures, and a valid plan on random batches."""

from __future__ import annotations

import pytest
import torch

from kdtree.capture import load
from kdtree.device_plan import PlanShape, plan_on_device
from kdtree.kernel import KernelConfig, plan
from kdtree.marshal import marshal

from conftest import SHIPPED, small, visible_key_tiles

CONFIGS = {
    "sm_90a": KernelConfig.for_arch("sm_90"),
    "sm_90a-no-few": KernelConfig.candidates("sm_90")[1],
    "mma32": KernelConfig(),
}


def check_same(args, heads, cfg, grid, device="cpu", **weights):
    """The device planner (its tensors on `device`) gives the host planner's arrays."""
    n = int(args.max_num_draft)
    shape = PlanShape(args.batch_size, n, heads, cfg, grid)
    want = plan(args, heads, grid, cfg, fused_merge=False, visible_keys=shape.visible_keys, **weights)  # grid blocks
    d = args.to(device)
    got = plan_on_device(d.qo_indptr, d.combined_kv_indptr, d.prefix_lens, d.tree_mask, shape, **weights).to("cpu")
    g = want.grid
    for name in ("rt_unit_start", "rt_request", "rt_row0", "rt_first_cta", "rt_seg_base", "row_merge"):
        assert torch.equal(got.arrays[name], want.arrays[name]), name
    assert torch.equal(got.arrays["cta_unit_start"][: g + 1], want.arrays["cta_unit_start"])
    assert (got.arrays["cta_unit_start"][g:] == want.units).all()  # trailing blocks are empty
    assert torch.equal(got.arrays["cta_first_rt"][:g], want.arrays["cta_first_rt"])
    assert want.segments <= shape.max_segments
    # the kernel's walk over the device plan covers every unit once, in the same segments
    assert [s for s in got.walk() if s[2] != s[3]] == want.walk()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_device_plan_matches_the_host_plan_on_the_shipped_captures(path, cfg):
    cap = load(path)
    if len(set(cap.num_draft.tolist())) > 1:
        pytest.skip("SGLang's batches have one N")
    args = marshal(cap)
    for grid in (1, 7, 132, 5000):
        check_same(args, cap.meta.num_heads, CONFIGS[cfg], grid)


@pytest.mark.parametrize(
    "weights",
    [dict(segment_units=0.0), dict(segment_units=10.0, short_segment_units=0.0), dict(short_segment_units=12.0)],
    ids=["equal-shares", "heavy-segments", "heavy-short-tiles"],
)
def test_device_plan_matches_with_other_segment_weights(weights):
    """The two planners agree with other segment weights too, equal unit counts (segment_units 0) among them, on
    a batch of short and long requests whose row tiles mix weights (few-row and short tiles)."""
    cap = small(seed=3, batch_size=4, prefix_lens=[100, 3, 2500, 700], budget=16)
    args = marshal(cap)
    for cfg in CONFIGS.values():
        for grid in (7, 132):
            check_same(args, cap.meta.num_heads, cfg, grid, **weights)


@pytest.mark.parametrize("seed", range(6))
def test_device_plan_matches_on_fresh_batches(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 17, 33, 65]))
    prefixes = [int(x) for x in rng.integers(0, 3000, int(rng.integers(1, 12)))]
    cap = small(seed=seed, tree="chain", num_draft_tokens=n, batch_size=len(prefixes), prefix_lens=prefixes, budget=None)
    for cfg in CONFIGS.values():
        check_same(marshal(cap), cap.meta.num_heads, cfg, int(rng.integers(1, 300)))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_device_plan_matches_the_host_plan_on_the_gpu(seed):
    """On CUDA tensors too (the serving path's): a GPU's scans add in another order than the host's, and the
    split's integer ticks make that order irrelevant. Batches with few-row and short row tiles (weights that are
    not whole units) and every segment weighting."""
    import numpy as np

    rng = np.random.default_rng(200 + seed)
    n = int(rng.choice([9, 17, 33, 65, 129]))
    prefixes = [int(x) for x in rng.integers(0, 6000, int(rng.integers(2, 24)))]
    prefixes[0] = int(rng.integers(0, 200))  # a short row tile
    cap = small(seed=seed, batch_size=len(prefixes), prefix_lens=prefixes, num_draft_tokens=n, budget=None)
    args = marshal(cap)
    for cfg in CONFIGS.values():
        for weights in ({}, dict(segment_units=0.0), dict(segment_units=10.0, short_segment_units=0.0)):
            check_same(args, cap.meta.num_heads, cfg, int(rng.integers(7, 300)), "cuda", **weights)


def check_valid(p, shape):
    """Every unit is walked once, by one block; partial slots are unique, below the bound, and the row lookup
    counts each split tile's blocks."""
    walked = {}
    slots = []
    for block, rt, k0, k1, slot in p.walk():
        for k in range(k0, k1):
            assert (rt, k) not in walked
            walked[rt, k] = block
        if slot is not None:
            slots.append(slot)
    starts = p.arrays["rt_unit_start"].tolist()
    assert sorted(walked) == [(rt, k) for rt in range(len(starts) - 1) for k in range(starts[rt + 1] - starts[rt])]
    assert len(slots) == len(set(slots)) and all(0 <= s < shape.max_segments for s in slots)
    live = min(shape.grid, starts[-1])
    cta = p.arrays["cta_unit_start"].tolist()
    assert all(cta[c + 1] > cta[c] for c in range(live)) and all(x == starts[-1] for x in cta[live:])


@pytest.mark.parametrize("seed", range(40))
def test_device_plan_is_valid_on_random_batches(seed):
    """Random lengths and tree bits: a valid plan whose row tiles end at the last key their rows may see where
    the draft spans more than 4 key tiles, and take all their keys below that."""
    import numpy as np

    rng = np.random.default_rng(100 + seed)
    bs, n, heads = int(rng.integers(1, 40)), int(rng.choice([1, 2, 9, 17, 33, 65, 129, 200, 257])), int(rng.choice([8, 16, 64]))
    prefix = rng.integers(0, 5000, bs) * (rng.random(bs) < 0.9)
    qo = torch.arange(bs + 1, dtype=torch.int32) * n
    combined = torch.tensor(np.concatenate([[0], np.cumsum(prefix + n)]), dtype=torch.int32)
    # random visibility, sparse or dense, some rows seeing no draft key
    words = (n + 31) // 32
    bits = (rng.random((bs * n, words * 32)) < rng.choice([0.02, 0.3])) & (np.arange(words * 32) < n)
    bits &= rng.random((bs * n, 1)) < 0.9
    tree_mask = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
    cfg = list(CONFIGS.values())[seed % len(CONFIGS)]
    shape = PlanShape(bs, n, heads, cfg, int(rng.integers(1, 400)))
    p = plan_on_device(qo, combined, torch.from_numpy(prefix.astype(np.int32)), tree_mask, shape)
    check_valid(p, shape)
    rt_request = p.arrays["rt_request"].numpy()
    if shape.visible_keys:  # drafts of more than 4 key tiles
        want = visible_key_tiles(qo, prefix, prefix + n, tree_mask, heads, cfg.bm, cfg.bn, rt_request, p.arrays["rt_row0"])
    else:
        want = np.maximum(1, -(-(prefix + n)[rt_request] // cfg.bn))
    assert np.diff(p.arrays["rt_unit_start"].numpy()).tolist() == want.tolist()


def test_last_visible_draft_key_reads_every_bit_of_the_words():
    """The word arithmetic (last nonzero word, its bit length through frexp) against the bits one by one:
    the sign bit of an int32 word, empty rows, several words, single bits at every position."""
    import numpy as np

    from kdtree.kernel import last_visible_draft_key

    rng = np.random.default_rng(0)
    bits = rng.random((200, 96)) < 0.05
    bits[:96] = np.eye(96, dtype=bool)  # each position alone, 31, 63 and 95 the words' sign bits
    bits[96:100] = False
    mask = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
    want = [int(np.flatnonzero(r)[-1]) if r.any() else -1 for r in bits]
    assert last_visible_draft_key(mask).tolist() == want
    assert last_visible_draft_key(torch.zeros(3, 0, dtype=torch.int32)).tolist() == [-1, -1, -1]


def test_lengths_that_disagree_with_the_mask_stay_inside_it():
    """A request shorter than the shape's N (lengths a server's scratch rows may hold): the device plan reads
    the mask's last row for the missing tokens instead of indexing past it, and still walks every unit once."""
    n, bs = 130, 2
    qo = torch.tensor([0, 131, 260], dtype=torch.int32)  # the shape says 2 x 130 tokens
    combined = torch.tensor([0, 141, 280], dtype=torch.int32)
    shape = PlanShape(bs, n, 8, KernelConfig(), 8)
    assert shape.visible_keys
    p = plan_on_device(qo, combined, torch.tensor([10, 10], dtype=torch.int32), torch.zeros(bs * n, 5, dtype=torch.int32), shape)
    check_valid(p, shape)


def test_a_batch_over_l2_runs_one_tile_a_block_on_the_device_too():
    """With `PlanShape.l2_bytes`, 130 equal row tiles (2 x 4,112 rows of DeepSeek-V3) on 132 blocks run one a block
    once their pool rows exceed L2: the host's plan over 130 blocks, the last two empty. Under L2, or with tiles
    too few for the blocks (8 x 520 rows: 72 tiles), the plan is the balanced one over all 132."""
    from kdtree.kernel.planner import pool_row_bytes
    from kdtree.synth import SynthSpec, synthesize

    cfg = CONFIGS["sm_90a-no-few"]
    cap = synthesize(
        SynthSpec(preset="deepseek-v3-tp8", batch_size=2, prefix_lens=[2000, 2000], budget=256, seed=2), reference=False
    )
    args, H = marshal(cap), cap.meta.num_heads
    n = int(args.max_num_draft)
    on_device = lambda l2: plan_on_device(  # noqa: E731
        args.qo_indptr, args.combined_kv_indptr, args.prefix_lens, args.tree_mask, PlanShape(2, n, H, cfg, 132, l2)
    )
    vis = PlanShape(2, n, H, cfg, 132).visible_keys
    whole = plan(args, H, 132, cfg, fused_merge=False, visible_keys=vis, grid=130)
    got = on_device(pool_row_bytes(args) - 1)
    assert torch.equal(got.arrays["cta_unit_start"][:131], whole.arrays["cta_unit_start"])
    assert (got.arrays["cta_unit_start"][130:] == whole.units).all()
    assert [s for s in got.walk() if s[2] != s[3]] == whole.walk()
    balanced = plan(args, H, 132, cfg, fused_merge=False, visible_keys=vis)
    for l2 in (pool_row_bytes(args), None):
        assert torch.equal(on_device(l2).arrays["cta_unit_start"], balanced.arrays["cta_unit_start"])
    few = synthesize(SynthSpec(batch_size=8, prefix_lens=[300] * 8, budget=64, seed=3), reference=False)
    fa = marshal(few)
    got = plan_on_device(fa.qo_indptr, fa.combined_kv_indptr, fa.prefix_lens, fa.tree_mask, PlanShape(8, 65, 8, cfg, 132, 1))
    assert torch.equal(
        got.arrays["cta_unit_start"], plan(fa, 8, 132, cfg, fused_merge=False, visible_keys=False).arrays["cta_unit_start"]
    )


def test_split_weights_must_be_whole_ticks_on_both_planners():
    """Weights count in thousandths of a unit (`SPLIT_TICKS`): one that is not (1/3) or a unit weight of no ticks is
    refused by both planners with the same error, instead of rounding differently on each (a sum rounded whole on
    the host, its parts on the device) or dividing by zero."""
    import numpy as np

    from kdtree.kernel.planner import balanced_split

    cap = small(seed=3, batch_size=4, prefix_lens=[100, 3, 2500, 700], budget=16)
    args, heads = marshal(cap), cap.meta.num_heads
    cfg = CONFIGS["sm_90a"]
    shape = PlanShape(args.batch_size, int(args.max_num_draft), heads, cfg, 132)
    for weights in (dict(segment_units=1 / 3), dict(short_segment_units=1 / 3), dict(few_unit_cost=1 / 3)):
        with pytest.raises(ValueError, match="thousandths"):
            plan(args, heads, 132, cfg, **weights)
        with pytest.raises(ValueError, match="thousandths"):
            plan_on_device(args.qo_indptr, args.combined_kv_indptr, args.prefix_lens, args.tree_mask, shape, **weights)
    with pytest.raises(ValueError, match="at least one tick"):
        balanced_split(np.array([0, 4, 8]), 2, 5.0, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="at least one tick"):
        plan_on_device(args.qo_indptr, args.combined_kv_indptr, args.prefix_lens, args.tree_mask, shape, few_unit_cost=0.0)
    # whole thousandths are taken, and agree
    check_same(args, heads, cfg, 132, segment_units=5.125, short_segment_units=0.875, few_unit_cost=0.625)
