"""The stream-K launch plan, checked on the CPU by walking it the way the kernel does."""

import dataclasses

import numpy as np
import pytest
import torch

from kdtree.capture import load
from kdtree.fuzz import fuzz_spec
from kdtree.kernel import (
    FEW_UNIT_COST,
    FUSED_MERGE_SEGS,
    SEGMENT_OVERHEAD_UNITS,
    SHORT_SEGMENT_UNITS,
    SHORT_TILE_UNITS,
    KernelConfig,
    aligned_split,
    balanced_split,
    plan,
)
from kdtree.marshal import marshal
from kdtree.synth import SynthSpec, synthesize

from conftest import SHIPPED, visible_key_tiles

CASES = [load(p) for p in SHIPPED[:3]] + [synthesize(fuzz_spec(s), reference=False) for s in (1, 2, 5, 11)]


@pytest.mark.parametrize("cap", CASES, ids=lambda c: f"bs{c.batch_size}-N{int(c.num_draft.max())}")
@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig.for_arch("sm_90")], ids=["bm32", "bm64"])
@pytest.mark.parametrize("num_sms", [1, 7, 132, 188])
@pytest.mark.parametrize("segment_units", [0.0, None, 17.0], ids=["equal", "default", "heavy"])
def test_every_work_unit_is_done_once_and_shares_are_balanced(cap, config, num_sms, segment_units):
    """Each unit in exactly one block, each partial slot written once, each row tile's units its keys up to the
    last one its rows may see, and the blocks' shares even: equal unit counts with segment_units 0, else equal
    units + segment_units per segment (within rounding)."""
    args = marshal(cap)
    H = cap.meta.num_heads
    p = plan(args, H, num_sms, config, segment_units=segment_units)
    a = {k: v.numpy() for k, v in p.arrays.items()}
    n = cap.num_draft.numpy()
    kv = (cap.prefix_lens + cap.num_draft).numpy()
    row_tiles = -(-n * H // config.bm)
    assert len(a["rt_request"]) == row_tiles.sum() == p.row_tiles and p.grid <= num_sms
    shares = np.diff(a["cta_unit_start"])
    assert shares.min() >= 1
    seg_units = SEGMENT_OVERHEAD_UNITS if segment_units is None else segment_units
    steps = p.walk()
    rows = np.minimum(config.bm, n[a["rt_request"]] * H - a["rt_row0"])
    weight = np.where(rows <= config.few_rows, FEW_UNIT_COST, 1.0) if config.wgmma else np.ones(len(rows))
    assert p.work == pytest.approx((np.diff(a["rt_unit_start"]) * weight).sum())
    # a segment of a short row tile weighs SHORT_SEGMENT_UNITS more
    rt_seg = seg_units + (np.diff(a["rt_unit_start"]) <= SHORT_TILE_UNITS) * (SHORT_SEGMENT_UNITS if seg_units else 0)
    cost = np.zeros(p.grid)
    for c, rt, k0, k1, _ in steps:
        cost[c] += (k1 - k0) * weight[rt] + rt_seg[rt]
    ideal = (p.work + rt_seg[1:].sum()) / p.grid + rt_seg.max()  # each block's share of the total
    if seg_units == 0:
        assert shares.max() - shares.min() <= 1
    else:
        assert cost.max() <= ideal + 2, (cost.max(), ideal)
    seen = {}
    slots = []
    for _block, rt, k0, k1, slot in steps:
        seen.setdefault(rt, []).append((k0, k1))
        if slot is not None:
            slots.append(slot)
    key_tiles = visible_key_tiles(
        args.qo_indptr, args.prefix_lens, kv, args.tree_mask, H, config.bm, config.bn, a["rt_request"], a["rt_row0"]
    )
    for rt, ranges in seen.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == key_tiles[rt]
        assert all(r0[1] == r1[0] for r0, r1 in zip(ranges, ranges[1:]))  # contiguous, no overlap
        split = len(ranges) > 1
        assert (a["rt_seg_base"][rt + 1] - a["rt_seg_base"][rt] > 0) == split
    assert len(seen) == len(a["rt_request"])
    assert sorted(slots) == list(range(p.segments))  # each partial slot written exactly once


@pytest.mark.parametrize("cap", CASES, ids=lambda c: f"bs{c.batch_size}-N{int(c.num_draft.max())}")
@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig.for_arch("sm_90")], ids=["bm32", "bm64"])
def test_row_merge_points_each_split_row_at_its_partials(cap, config):
    """verify_mla_merge's per-row lookup: for every row (token * H + head) of a split tile, the partial line
    (slot * BM + row in tile) of the first block that wrote it and the tile's number of partials; 0 partials for
    rows of tiles one block wrote whole."""
    args = marshal(cap)
    H = cap.meta.num_heads
    p = plan(args, H, 132, config)
    a = {k: v.numpy() for k, v in p.arrays.items()}
    row_merge = a["row_merge"].reshape(-1, 2)
    assert row_merge.shape == (p.total_rows, 2)
    slots = {}
    for _, rt, _, _, slot in p.walk():
        slots.setdefault(rt, []).append(slot)
    qo = args.qo_indptr.numpy()
    expected = np.zeros((p.total_rows, 2), dtype=np.int64)
    for rt, rt_slots in slots.items():
        b, row0 = a["rt_request"][rt], a["rt_row0"][rt]
        rows = (qo[b + 1] - qo[b]) * H
        for tr in range(min(config.bm, rows - row0)):
            if len(rt_slots) > 1:
                expected[qo[b] * H + row0 + tr] = (min(rt_slots) * config.bm + tr, len(rt_slots))
    assert (row_merge == expected).all()
    assert (row_merge[:, 1] > 0).any() == p.split


@pytest.mark.parametrize("cap", CASES, ids=lambda c: f"bs{c.batch_size}-N{int(c.num_draft.max())}")
@pytest.mark.parametrize("arch", ["sm_100", "sm_90"], ids=["bm64-mma.sync", "wgmma"])
def test_fused_merge_only_for_short_splits(cap, arch):
    """By default the mma.sync paths merge short splits in the kernel, the wgmma segment never does; asking
    for a fused merge of a tile split more than FUSED_MERGE_SEGS ways is refused."""
    args = marshal(cap)
    config = KernelConfig.for_arch(arch)
    for num_sms in (7, 132, 188):
        p = plan(args, cap.meta.num_heads, num_sms, config)
        segs = np.diff(p.arrays["rt_seg_base"].numpy())
        assert p.fused_merge == (p.segments > 0 and segs.max() <= FUSED_MERGE_SEGS and not config.wgmma)
        if segs.max() > FUSED_MERGE_SEGS:
            with pytest.raises(ValueError, match="fused merge"):
                plan(args, cap.meta.num_heads, num_sms, config, fused_merge=True)


def test_the_plan_picks_the_cheaper_configuration_per_batch():
    """By the cost model fitted to H200 runs: on sm_90 (split_keys at 64 rows with and without few-row tiles,
    blocks64, mma.sync at 32) the small tree, the 4k batch and 64 x N1
    keep split_keys with few-row tiles (0.054 / 0.038 / 0.095 ms against 0.059 / 0.040 / 0.110 on
    blocks64, whose segments cost more and are padded to pairs of blocks:
    docs/history/bench/variants-b64-segment-weight-h200.log), the other batches take blocks64 (32k x4 1.131 against
    1.453 ms; mixed 0.227 against 0.242, docs/history/bench/variants-short-segments-main-h200.log; mma.sync at 32 rows
    measured 1.15x a wgmma unit's time); where 64 rows means mma.sync (sm_100), the small tree and the 4k batch take
    32 rows (v7: 0.088 vs 0.098 ms)."""
    from kdtree.bench import ANCHOR_CASES, BENCH_CASES
    from kdtree.kernel import choose_plan

    def chosen(arch, cases=ANCHOR_CASES):
        configs = KernelConfig.candidates(arch)
        out = {}
        for case in cases:
            cap = synthesize(case.spec(), reference=False)
            c = choose_plan(marshal(cap), cap.meta.num_heads, 132, configs).config
            out[case.name] = c.body
        return out

    assert [(c.wgmma, c.bm, c.few_rows, c.blocks64) for c in KernelConfig.candidates("sm_90")] == [
        (True, 64, 16, False),
        (True, 64, 0, True),
        (True, 64, 0, False),
        (False, 32, 0, False),
    ]
    assert KernelConfig.candidates("sm_120") == (KernelConfig(),)
    hopper = chosen("sm_90", BENCH_CASES)
    few = [hopper.pop(k) for k in ("kimi-tp8 small tree", "kimi-tp8 ddtree64 4k", "kimi-tp8 64 x N1 4k")]
    assert few == ["split_keys+few"] * 3, hopper
    assert set(hopper.values()) == {"blocks64"}, hopper
    blackwell_dc = chosen("sm_100")
    assert blackwell_dc["kimi-tp8 small tree"] == blackwell_dc["kimi-tp8 ddtree64 4k"] == "mma32", blackwell_dc
    assert all(v == "mma64" for k, v in blackwell_dc.items() if any(s in k for s in ("8k x8", "32k", "128k", "kimi-dp"))), (
        blackwell_dc
    )


def test_balanced_split_moves_units_to_blocks_with_fewer_segments():
    """Three row tiles of 10 units on 3 blocks: equal shares when segments are free; with a segment overhead the
    boundaries land on row tile starts (no split, 3 segments instead of 5); many short row tiles after a long one
    give the block holding them fewer units; every block keeps a unit even when the overhead dwarfs the work."""
    starts = np.array([0, 10, 20, 30])
    assert balanced_split(starts, 3, 0).tolist() == [0, 10, 20, 30]
    assert balanced_split(np.array([0, 12, 18, 30]), 3, 0).tolist() == [0, 10, 20, 30]
    assert balanced_split(np.array([0, 12, 18, 30]), 3, 5.0).tolist() == [0, 12, 18, 30]
    many = np.concatenate([[0], 60 + np.arange(0, 31, 3)])  # one 60-unit tile, then ten 3-unit tiles
    assert balanced_split(many, 2, 0).tolist() == [0, 45, 90]  # 45 units each, the second block in 11 segments
    assert balanced_split(many, 2, 5.0).tolist() == [0, 63, 90]  # 63 + 2 x 5 against 27 + 9 x 5
    tight = balanced_split(np.arange(0, 9), 8, 100.0)
    assert tight.tolist() == list(range(9))
    # each row tile's own segment cost: the short tiles' 11 instead of 5 move 4 more units to the first block
    assert balanced_split(many, 2, np.full(11, 5.0)).tolist() == [0, 63, 90]
    assert balanced_split(many, 2, np.array([5.0] + [11.0] * 10)).tolist() == [0, 67, 90]  # 67 + 5 + 3 x 11, 23 + 8 x 11
    # row tiles of cheaper units (few-row tiles): a block takes more of them for the same work
    assert balanced_split(starts, 3, 5.0).tolist() == [0, 10, 20, 30]
    assert balanced_split(starts, 3, 5.0, np.array([1.0, 1.0, 0.5])).tolist() == [0, 10, 18, 30]
    assert balanced_split(starts, 2, 5.0).tolist() == [0, 15, 30]
    assert balanced_split(starts, 2, 5.0, np.array([0.5, 1.0, 1.0])).tolist() == [0, 18, 30]


def test_aligned_split_cuts_the_tiles_of_a_long_request_alike():
    """A request's row tiles worth at least `min_shares` blocks' shares each are cut at the same offsets (within its
    shortest tile, halves up, in multiples of `pad`), one block a piece; the other tiles share the remaining blocks;
    alone, the grid shrinks to the pieces. None where no request is that long, where a tile is under two `pad`s, or
    where the largest block would hold over ALIGN_SLACK times the balanced split's largest."""
    from kdtree.kernel.planner import ALIGN_SLACK, block_costs

    starts = np.array([0, 200, 400, 601, 800])  # a 200-unit tile of request 0; tiles of 200, 201 and 199 of request 1
    request, zero, one = np.array([0, 1, 1, 1]), np.zeros(4), np.ones(4)
    assert aligned_split(starts, request, 8, zero, one, 1.5).tolist() == [0, 100, 200, 300, 400, 500, 601, 701, 800]
    assert aligned_split(starts, request, 8, zero, one, 1.5, pad=8).tolist() == [0, 100, 200, 296, 400, 496, 601, 697, 800]
    assert aligned_split(starts, request, 8, zero, one, 3.0) is None  # no tile is worth 3 shares
    lone = aligned_split(np.array([0, 700, 1400]), np.zeros(2, int), 29, np.zeros(2), np.ones(2), 2.0)
    assert lone.tolist() == list(range(0, 1401, 50))  # 14 pieces a tile on 28 of the 29 blocks
    assert aligned_split(np.array([0, 4, 8]), np.zeros(2, int), 8, np.full(2, 11.0), np.ones(2), 3.0, pad=4) is None
    rng = np.random.default_rng(0)
    for _ in range(300):  # random batches: valid boundaries, no block over the slack, long tiles cut alike
        tiles = rng.integers(1, 6, size=rng.integers(1, 5))
        req = np.repeat(np.arange(len(tiles)), tiles)
        lens = np.concatenate([np.full(t, rng.integers(1, 2000)) + rng.integers(0, 3, t) for t in tiles])
        starts = np.concatenate([[0], np.cumsum(lens)])
        seg, weight, grid = rng.choice([0.0, 5.0]), np.ones(len(lens)), int(rng.integers(2, 200))
        if grid > starts[-1]:
            continue
        b = aligned_split(starts, req, grid, seg, weight, float(rng.choice([2.0, 3.0, 6.0])), int(rng.choice([1, 4])))
        if b is None:
            continue
        assert b[0] == 0 and b[-1] == starts[-1] and (np.diff(b) > 0).all() and len(b) <= grid + 1
        balanced = block_costs(balanced_split(starts, grid, seg, weight), starts, seg, weight).max()
        assert block_costs(b, starts, seg, weight).max() <= ALIGN_SLACK * balanced + 1e-9


def test_plans_with_long_requests_aligned_still_do_every_unit_once():
    """plan(align_shares=...) on mixed (its 45,000-key request's nine row tiles each worth ~9 shares): those tiles
    are cut at the same offsets, in 64-key pairs of blocks, and the walk still does every unit once and writes every
    partial slot once; on the small tree, which has no such request, it is the balanced plan; 128k, one request,
    gets a grid of its pieces."""
    from kdtree.bench import ANCHOR_CASES

    config = KernelConfig.for_arch("sm_90a-blocks64")
    by_name = {c.name: c for c in ANCHOR_CASES}
    for name, shares in (("kimi-tp8 mixed", 6.0), ("kimi-tp8 ddtree64 128k", 3.0)):
        cap = synthesize(by_name[name].spec(), reference=False)
        p = plan(marshal(cap), cap.meta.num_heads, 132, config, align_shares=shares)
        a = {k: v.numpy() for k, v in p.arrays.items()}
        long = np.flatnonzero(a["rt_request"] == len(cap.prefix_lens) - 1)  # the last request is the longest in both
        t0, t1 = a["rt_unit_start"][long], a["rt_unit_start"][long + 1]
        cuts = [[int(x - lo) for x in a["cta_unit_start"] if lo <= x < hi] for lo, hi in zip(t0, t1)]
        assert all(c == cuts[0] for c in cuts) and len(cuts[0]) >= 2 and all(x % 4 == 0 for x in cuts[0]), name
        ranges, slots = {}, []
        for _c, rt, k0, k1, slot in p.walk():
            ranges.setdefault(rt, []).append((k0, k1))
            slots += [] if slot is None else [slot]
        for rt, r in ranges.items():
            r.sort()
            assert r[0][0] == 0 and r[-1][1] == a["rt_unit_start"][rt + 1] - a["rt_unit_start"][rt], name
            assert all(x[1] == y[0] for x, y in zip(r, r[1:])), name
        assert len(ranges) == p.row_tiles and sorted(slots) == list(range(p.segments)), name
        if name.endswith("128k"):
            assert p.grid == len(long) * len(cuts[0]) <= 132
    cap = synthesize(by_name["kimi-tp8 small tree"].spec(), reference=False)
    aligned, balanced = (plan(marshal(cap), cap.meta.num_heads, 132, config, align_shares=s) for s in (3.0, None))
    assert all(torch.equal(aligned.arrays[k], balanced.arrays[k]) for k in balanced.arrays)


def test_choose_plan_cuts_only_mixed_alike(monkeypatch):
    """Of the twelve bench cases on sm_90's candidates (with and without the H200's L2), only mixed takes the aligned
    candidate: its 45,000-key request cut alike on blocks64, the plan the cost model weighs cheapest (0.208 ms
    against 0.224 balanced, docs/history/bench/variants-aligned-h200.log); with no request long enough, or `aligned`=False,
    it is the balanced plan on blocks64 again."""
    import kdtree.kernel.planner as planner
    from kdtree.bench import BENCH_CASES
    from kdtree.kernel import choose_plan

    configs = KernelConfig.candidates("sm_90")
    picked = {}
    for case in BENCH_CASES:
        cap = synthesize(case.spec(), reference=False)
        args, H = marshal(cap), cap.meta.num_heads
        for l2 in (None, 60 << 20):
            p = choose_plan(args, H, 132, configs, l2_bytes=l2)
            if p.aligned:
                assert p.config.blocks64 and p.split, case.name
                picked[case.name] = p
    assert sorted(picked) == ["kimi-tp8 mixed"]
    cap = synthesize(next(c for c in BENCH_CASES if c.name == "kimi-tp8 mixed").spec(), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    off = choose_plan(args, H, 132, configs, aligned=False)
    monkeypatch.setattr(planner, "ALIGN_SHARES", 1e9)
    p = choose_plan(args, H, 132, configs)
    assert not p.aligned and p.config.blocks64
    assert p.arrays["cta_unit_start"].tolist() == off.arrays["cta_unit_start"].tolist() and not off.aligned
    assert planner.estimated_cost(p) > planner.estimated_cost(picked["kimi-tp8 mixed"])


def test_short_row_tiles_weigh_their_segments_more():
    """A row tile of at most SHORT_TILE_UNITS key tiles pays SHORT_SEGMENT_UNITS more a segment: the block that
    holds two short requests' row tiles takes fewer units than when they weigh as any other, the other blocks
    more; a batch without short tiles is planned the same either way."""
    cfg = KernelConfig.for_arch("sm_90")
    mixed = marshal(synthesize(SynthSpec(preset="kimi-k2-tp8", batch_size=3, prefix_lens=[100, 3, 6000], budget=64, seed=0)))
    p, p0 = plan(mixed, 8, 16, cfg), plan(mixed, 8, 16, cfg, short_segment_units=0.0)
    tiles = np.diff(p.arrays["rt_unit_start"].numpy())
    assert (tiles[:18] <= SHORT_TILE_UNITS).all() and (tiles[18:] > SHORT_TILE_UNITS).all()  # 9 row tiles a request
    shares, shares0 = (np.diff(q.arrays["cta_unit_start"].numpy()) for q in (p, p0))
    assert shares[0] < shares0[0] and p.block_segments[0] <= p0.block_segments[0]

    def costs(q):  # each block's units + its segments, a short tile's at SHORT_SEGMENT_UNITS more
        c = np.diff(q.arrays["cta_unit_start"].numpy()).astype(float)
        for blk, rt, *_ in q.walk():
            c[blk] += SEGMENT_OVERHEAD_UNITS + SHORT_SEGMENT_UNITS * (tiles[rt] <= SHORT_TILE_UNITS)
        return c

    assert costs(p).max() < costs(p0).max()  # by that measure the slowest block is faster
    long_only = marshal(synthesize(SynthSpec(preset="kimi-k2-tp8", batch_size=2, prefix_lens=[900, 6000], budget=64, seed=0)))
    q, q0 = plan(long_only, 8, 16, cfg), plan(long_only, 8, 16, cfg, short_segment_units=0.0)
    assert all(torch.equal(q.arrays[k], q0.arrays[k]) for k in q.arrays)


def test_few_row_tiles_are_planned_cheaper_where_the_kernel_runs_them():
    """The small tree's third row tile per request (node 16 x 8 heads: 8 rows) is a few-row tile on the wgmma
    configuration: its units count FEW_UNIT_COST each in the plan's work, so blocks holding them take more units;
    with few_rows 0, or on the mma.sync paths, every unit counts 1."""
    import dataclasses

    from kdtree.bench import ANCHOR_CASES

    cap = synthesize(next(c for c in ANCHOR_CASES if c.name == "kimi-tp8 small tree").spec(), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    wg = KernelConfig.for_arch("sm_90")
    assert wg.few_rows == 16
    p = plan(args, H, 132, wg)
    rows = np.minimum(64, cap.num_draft.numpy()[p.arrays["rt_request"].numpy()] * H - p.arrays["rt_row0"].numpy())
    assert sorted(set(rows.tolist())) == [8, 64]
    key_units = np.diff(p.arrays["rt_unit_start"].numpy())
    assert p.work == pytest.approx(key_units[rows == 64].sum() + FEW_UNIT_COST * key_units[rows == 8].sum())
    assert p.work < p.units
    for off in (plan(args, H, 132, dataclasses.replace(wg, few_rows=0)), plan(args, H, 132, KernelConfig())):
        assert off.work == off.units
    # the blocks whose units are all few-row units hold more of them than the others' average: at least half of
    # the 1 / FEW_UNIT_COST times as many (segment costs, the same in both, dilute it)
    cta = p.arrays["cta_unit_start"].numpy()
    few_units = np.repeat(rows == 8, key_units)
    shares = np.diff(cta)
    all_few = np.array([few_units[cta[c] : cta[c + 1]].all() for c in range(p.grid)])
    assert all_few.any() and shares[all_few].mean() > (1 + 0.5 * (1 / FEW_UNIT_COST - 1)) * shares[~all_few].mean()


def test_bench_case_selection():
    """Substrings pick bench cases; probe cases (experiments only) come only by exact name and on request."""
    from kdtree.bench import BENCH_CASES, PROBE_CASES, select_cases

    assert [c.name for c in select_cases(["small tree"])] == ["kimi-tp8 small tree"]
    assert [c.name for c in select_cases(["small tree", "small tree N8"], probes=True)] == [
        "kimi-tp8 small tree",
        "small tree N8",
    ]
    assert select_cases(["small tree N8"]) == [] and select_cases(["8k"]) == [c for c in BENCH_CASES if "8k" in c.name]
    assert {c.num_draft * 8 for c in PROBE_CASES} == {16, 64, 72, 128}  # rows a request at H 8


def test_timed_calls_cycle_through_the_input_sets():
    """Each timed call reads the next rotated input set, in order, wrapping around (no two calls in a row on the
    same inputs when there are two or more sets)."""
    from kdtree.bench import cycling

    seen = []
    fn = cycling([("q0", "pool0"), ("q1", "pool1"), ("q2", "pool2")], lambda q, pool: seen.append((q, pool)))
    for _ in range(7):
        fn()
    assert seen == [(f"q{i % 3}", f"pool{i % 3}") for i in range(7)]


def test_graphed_timing_falls_back_to_eager_calls_where_capture_fails():
    """Without a GPU (or where a step cannot be captured) the timed calls run the step eagerly, still cycling
    through the input sets, and the record says why."""
    from kdtree.bench import graphed

    if torch.cuda.is_available():
        pytest.skip("capture works here: the GPU test replays the graphs")
    seen = []
    fn, how = graphed([("q0", "pool0"), ("q1", "pool1")], lambda q, pool: seen.append((q, pool)))
    for _ in range(3):
        fn()
    assert seen == [("q0", "pool0"), ("q1", "pool1"), ("q0", "pool0")]
    assert how.startswith("eager (graph capture failed:")


@pytest.mark.gpu
def test_graphed_replays_keep_what_their_kernels_read_alive():
    """The graphs read tensors that only the step references (a plan, outputs): replayed after the caller dropped
    its references, the step and its tensors are still alive, and with the allocator's freed blocks (small and
    large) handed out again the replays still read and write the right ones."""
    import gc
    import weakref

    from kdtree.bench import graphed

    def make():
        src = [torch.full((1 << 20,), float(i + 1), device="cuda") for i in range(2)]
        out = torch.zeros(1 << 20, device="cuda")
        scale = torch.tensor([3.0], device="cuda")  # referenced by the step alone

        def step(q, pool):
            torch.mul(q, scale, out=out)

        fn, how = graphed([(s, None) for s in src], step)
        return fn, how, out, weakref.ref(step), weakref.ref(scale)

    fn, how, out, step_ref, scale_ref = make()
    gc.collect()
    assert how == "cuda graph"
    assert step_ref() is not None and scale_ref() is not None
    junk = [torch.full((1 << 20,), -7.0, device="cuda") for _ in range(8)]
    junk += [torch.full((1,), -7.0, device="cuda") for _ in range(64)]  # the small pool's blocks too
    for i in range(4):
        fn()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 3.0 * (i % 2 + 1)))
    del junk


def test_few_row_units_are_weighed_by_the_body_that_runs_them():
    """A few-row unit costs 0.8 of a split_keys wgmma unit and 0.6 of a dims_split one (their measured ratios): each
    body's plans balance its own weight, unless one is given."""

    from kdtree.bench import ANCHOR_CASES
    from kdtree.kernel import FEW_UNIT_COST, few_row_weight
    from kdtree.kernel.planner import FEW_UNIT_COST_DIMS

    split = KernelConfig.for_arch("sm_90")
    dims = split.dims_split()
    assert few_row_weight(split) == FEW_UNIT_COST != FEW_UNIT_COST_DIMS == few_row_weight(dims)
    cap = synthesize(next(c for c in ANCHOR_CASES if c.name == "kimi-tp8 small tree").spec(), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    p_split, p_dims = plan(args, H, 132, split), plan(args, H, 132, dims)
    few_units = (p_split.units - p_split.work) / (1 - FEW_UNIT_COST)
    assert few_units > 0 and p_dims.work == pytest.approx(p_split.units - (1 - FEW_UNIT_COST_DIMS) * few_units)
    assert plan(args, H, 132, dims, few_unit_cost=FEW_UNIT_COST).work == pytest.approx(p_split.work)


def test_a_split_key_configuration_must_be_the_4_stage_wgmma_body():
    import dataclasses

    base = KernelConfig.for_arch("sm_90")
    for bad in (dict(stages=3), dict(wg_pipe=1), dict(wgmma=False)):
        with pytest.raises(ValueError, match="split_keys"):
            dataclasses.replace(base, **bad)
    assert not dataclasses.replace(base, stages=3, wg_pipe=1, split_keys=False).split_keys


def test_a_scripts_defines_become_switches():
    """--define NAME=VALUE strings append to a configuration's switches; anything else is refused by name."""
    base = KernelConfig(extra=(("VMLA_TRACE", 132),))
    assert base.with_defines(["VMLA_SKIP_QK=1", "VMLA_X=-2"]).extra == (("VMLA_TRACE", 132), ("VMLA_SKIP_QK", 1), ("VMLA_X", -2))
    assert base.with_defines([]) == base
    for bad in ("VMLA_SKIP_QK", "=1", "VMLA_SKIP_QK=one"):
        with pytest.raises(ValueError, match=repr(bad)):
            base.with_defines([bad])


def test_a_case_is_set_up_for_one_launch():
    """The timing scripts' setup: a bench case synthesized, marshaled and planned, with layer 0's q and pool and
    outputs and a workspace sized for its plan, all on the device asked for."""
    from kdtree.bench import case_launch, select_cases

    (case,) = select_cases(["small tree"])
    run = case_launch(case, lambda args, H: plan(args, H, 7, KernelConfig.for_arch("sm_90")), device="cpu")
    T, H = run.cap.num_tokens, run.cap.meta.num_heads
    assert run.plan.grid == 7 and run.q.shape == (T, H, 576) and run.o.shape == (T, H, 512) and run.lse.shape == (T, H)
    assert run.workspace.part_o.shape[0] == max(1, run.plan.segments) and run.pool.shape[-1] == 576
    assert run.args.tree_mask.device.type == "cpu"


def test_blocks64_needs_split_keys_and_no_few_row_tiles():
    """KernelConfig.blocks64 runs its 64-key blocks in split_keys' four stages, and beside the
    few-row segment it spills: a configuration asking for either other layout is refused by name."""
    hopper = KernelConfig.for_arch("sm_90")
    blocks64 = KernelConfig.for_arch("sm_90a-blocks64")
    assert blocks64.defines()["VMLA_BLOCKS64"] == 1 and hopper.defines()["VMLA_BLOCKS64"] == 0
    assert blocks64 in KernelConfig.candidates("sm_90")  # the configuration the cost model picks for long batches
    with pytest.raises(ValueError, match="blocks64 needs split_keys and few_rows=0"):
        dataclasses.replace(hopper, blocks64=True)  # few-row tiles
    with pytest.raises(ValueError, match="blocks64 needs split_keys"):
        dataclasses.replace(hopper.dims_split(), few_rows=0, blocks64=True)
    # KDTREE_KERNEL_TARGET=sm_90a-blocks64 runs it alone (compute-sanitizer, experiments), as sm_90a split_keys
    assert KernelConfig.for_arch("sm_90a-blocks64") == blocks64 and KernelConfig.candidates("sm_90a-blocks64") == (blocks64,)
    assert KernelConfig.candidates("sm_90a") == (KernelConfig.for_arch("sm_90a"),) != (blocks64,)


def test_a_kernel_target_outside_the_known_names_is_refused(monkeypatch):
    """$KDTREE_KERNEL_TARGET names a target or a Hopper body alone; a typo is an error naming the variable, not a
    silent run of the default configuration."""
    from kdtree.kernel.config import TARGET_NAMES, configs_for, target_arch

    monkeypatch.setenv("KDTREE_KERNEL_TARGET", "sm_90a-blocks64")
    assert target_arch() == "sm_90a-blocks64" and configs_for(None) == (KernelConfig.for_arch("sm_90a-blocks64"),)
    monkeypatch.setenv("KDTREE_KERNEL_TARGET", "sm_90a-Blocks64")
    with pytest.raises(ValueError, match="KDTREE_KERNEL_TARGET='sm_90a-Blocks64'"):
        configs_for(None)
    assert {"sm_120", "sm_90", "sm_90a", "sm_90a-blocks64"} <= set(TARGET_NAMES)


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_the_cost_is_the_slowest_blocks(arch):
    """estimated_cost charges the block that ends the launch: each block's weighted units are its share of the
    plan's work (they add up to it), padded per segment as its body runs it, and its segments are the row tiles the
    kernel's walk visits in it; the cost is the largest block's, at least the mean, and a device plan without the
    per-block figures gets the mean."""
    from kdtree.bench import ANCHOR_CASES
    from kdtree.kernel import estimated_cost
    from kdtree.kernel.planner import SEGMENT_COST_PER_ROW, UNIT_COST, cost_kind, few_row_weight, padded_units

    for case in ANCHOR_CASES:
        cap = synthesize(case.spec(), reference=False)
        for config in KernelConfig.candidates(arch):
            p = plan(marshal(cap), cap.meta.num_heads, 132, config)
            assert p.block_work.shape == p.block_segments.shape == (p.grid,)
            assert np.isclose(p.block_work.sum(), p.work), case.name
            visits = np.bincount([blk for blk, *_ in p.walk()], minlength=p.grid)
            assert (p.block_segments == visits).all(), case.name
            # each segment rounded up to its body's step (a 64-key pair of blocks: 4 tiles; a split_keys step: 2),
            # a few-row tile's not, x its tile's weight: summed over the kernel's walk
            pad = padded_units(config)
            a = {k: v.numpy() for k, v in p.arrays.items()}
            rows = np.minimum(config.bm, cap.num_draft.numpy()[a["rt_request"]] * cap.meta.num_heads - a["rt_row0"])
            few = rows <= config.few_row_limit
            weight = np.where(few, few_row_weight(config), 1.0)
            walked = np.zeros(p.grid)
            for blk, rt, k0, k1, _ in p.walk():
                walked[blk] += weight[rt] * ((k1 - k0) if few[rt] else -(-(k1 - k0) // pad) * pad)
            assert np.allclose(p.block_padded_work, walked), case.name
            assert pad == 1 or (p.block_padded_work > p.block_work + 1e-9).any(), case.name  # some segment padded
            mean = estimated_cost(dataclasses.replace(p, block_work=None, block_segments=None, block_padded_work=None))
            cost = estimated_cost(p)
            assert cost >= mean * (1 - 1e-9), case.name
            unit = UNIT_COST.get(cost_kind(config), config.bm / 64 * UNIT_COST["mma64"])
            assert cost >= p.block_work.max() * unit + SEGMENT_COST_PER_ROW * config.bm * 0.99, case.name


def test_batches_over_l2_with_fewer_row_tiles_than_blocks_run_one_tile_a_block():
    """With the H200's 60 MiB of L2, of the twelve bench cases only DeepSeek-V3 32k x2 changes plan: 130 row tiles
    on 72.6 MiB of pool rows run one a block on 130 blocks, nothing split (1.121 against 1.345 ms balanced over
    132). 8k x8, mixed, 128k and 64 x N1 (over L2, fewer tiles than blocks) stay balanced: one tile a block would
    leave 60, 78, 123 and 68 of the 132 blocks idle. ddtree1024 (129 tiles on 10.1 MiB) fits L2 and keeps its plan;
    so does every case on a 128 MiB L2, and with no L2 size."""
    from kdtree.bench import BENCH_CASES
    from kdtree.kernel import choose_plan
    from kdtree.kernel.planner import pool_row_bytes

    configs = KernelConfig.candidates("sm_90")
    changed = []
    for case in BENCH_CASES:
        cap = synthesize(case.spec(), reference=False)
        args, H = marshal(cap), cap.meta.num_heads
        base = choose_plan(args, H, 132, configs)
        for same in (choose_plan(args, H, 132, configs, l2_bytes=0), choose_plan(args, H, 132, configs, l2_bytes=128 << 20)):
            assert (same.config, same.arrays["cta_unit_start"].tolist()) == (base.config, base.arrays["cta_unit_start"].tolist())
        p = choose_plan(args, H, 132, configs, l2_bytes=60 << 20)
        if (p.config, p.grid, p.segments) != (base.config, base.grid, base.segments):
            changed.append(case.name)
            assert pool_row_bytes(args) > 60 << 20 and base.row_tiles < base.grid, case.name
            assert (p.grid, p.segments) == (p.row_tiles, 0) and base.split, case.name
    assert changed == ["dsv3-tp8 ddtree256 32k x2"]


def test_over_l2_a_split_plan_costs_l2_spread_cost_more(monkeypatch):
    """108 row tiles of DeepSeek-V3 (2 x 3,408 rows on 8,213 keys) on 132 blocks: by the cost model alone the
    batch is balanced over all 132 (nearly every tile split); over L2, at L2_SPREAD_COST, it runs one tile a
    block."""
    import kdtree.kernel.planner as planner
    from kdtree.kernel import choose_plan

    cap = synthesize(
        SynthSpec(preset="deepseek-v3-tp8", batch_size=2, prefix_lens=[8000, 8000], budget=212, seed=2), reference=False
    )
    args, H = marshal(cap), cap.meta.num_heads
    configs = KernelConfig.candidates("sm_90")
    p = choose_plan(args, H, 132, configs, l2_bytes=1)
    assert (p.grid, p.row_tiles, p.segments) == (108, 108, 0)
    monkeypatch.setattr(planner, "L2_SPREAD_COST", 0.0)
    p = choose_plan(args, H, 132, configs, l2_bytes=1)
    assert p.grid == 132 and p.split


def test_a_grid_of_one_row_tile_a_block():
    """`plan(grid=...)` below one block an SM slot: 130 equal row tiles (all keys) on 130 of 132 blocks run whole, one a block
    (every unit once, nothing split, no partial slots), where balanced over all 132 every tile is split in two; the
    cost model counts the two segments a block of that split (tools/variants.py times both)."""
    from kdtree.kernel import estimated_cost

    cap = synthesize(
        SynthSpec(preset="deepseek-v3-tp8", batch_size=2, prefix_lens=[2000, 2000], budget=256, seed=2), reference=False
    )
    args, H = marshal(cap), cap.meta.num_heads
    config = next(c for c in KernelConfig.candidates("sm_90") if c.blocks64)
    spread = plan(args, H, 132, config, visible_keys=False)  # every tile over all its request's keys: equal tiles
    assert spread.row_tiles == 130 and spread.grid == 132 and spread.segments > 0
    assert (spread.block_segments == 2).sum() > 100  # most blocks work on two row tiles
    whole = plan(args, H, 132, config, visible_keys=False, grid=spread.row_tiles)
    walked = whole.walk()
    assert (whole.grid, whole.segments) == (130, 0) and all(slot is None for *_, slot in walked)
    assert [(blk, rt) for blk, rt, *_ in walked] == [(c, c) for c in range(130)]  # tile c on block c, whole
    assert estimated_cost(whole) < estimated_cost(spread)
    assert plan(args, H, 132, config, visible_keys=False, grid=500).grid == 132  # never past one block an SM slot
    for bad in (0, -5):
        with pytest.raises(ValueError, match="grid must be at least 1"):
            plan(args, H, 132, config, grid=bad)


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_a_block_runs_its_last_segment_first(arch):
    """The walk (the kernel's order): a block working on several row tiles starts with its last, from that tile's
    key 0, then takes the others in unit order; built with VMLA_LAST_SEGMENT_FIRST=0, all in unit order. Both
    orders cover the same segments."""
    cap = synthesize(SynthSpec(preset="kimi-k2-tp8", batch_size=8, prefix_lens=[1500], budget=64, seed=3), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    config = KernelConfig.for_arch(arch)
    walks = {}
    for first in (True, False):
        c = config if first else config.in_unit_order()
        assert c.last_segment_first == first
        p = plan(args, H, 132, c)
        blocks = {}
        for blk, rt, k0, k1, _ in p.walk():
            blocks.setdefault(blk, []).append((rt, k0, k1))
        walks[first] = blocks
    several = [b for b, segs in walks[False].items() if len(segs) > 1]
    assert len(several) > 20
    for b, segs in walks[False].items():
        assert [rt for rt, *_ in segs] == sorted(rt for rt, *_ in segs)
        if len(segs) > 1:
            assert walks[True][b] == segs[-1:] + segs[:-1] and segs[-1][1] == 0
        else:
            assert walks[True][b] == segs
