"""The stream-K launch plan, checked on the CPU by walking it the way the kernel does."""

import numpy as np
import pytest

from kdtree.capture import load
from kdtree.fuzz import fuzz_spec
from kdtree.kernel import FUSED_MERGE_SEGS, KernelConfig, plan
from kdtree.marshal import marshal
from kdtree.synth import synthesize

from conftest import SHIPPED


def walk(p, bn):
    """Replay verify_mla_fwd's loop: (block, row tile, first key tile, end key tile, partial slot or None)."""
    a = {k: v.numpy() for k, v in p.arrays.items()}
    out = []
    for c in range(p.grid):
        u, u_end, rt = a["cta_unit_start"][c], a["cta_unit_start"][c + 1], a["cta_first_rt"][c]
        while u < u_end:
            t0, t1 = a["rt_unit_start"][rt], a["rt_unit_start"][rt + 1]
            seg_end = min(u_end, t1)
            segs = a["rt_seg_base"][rt + 1] - a["rt_seg_base"][rt]
            slot = a["rt_seg_base"][rt] + (c - a["rt_first_cta"][rt]) if segs > 1 else None
            out.append((c, rt, u - t0, seg_end - t0, slot))
            u, rt = seg_end, rt + 1
    return out


CASES = [load(p) for p in SHIPPED[:3]] + [synthesize(fuzz_spec(s), reference=False) for s in (1, 2, 5, 11)]


@pytest.mark.parametrize("cap", CASES, ids=lambda c: f"bs{c.batch_size}-N{int(c.num_draft.max())}")
@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig.for_arch("sm_90")], ids=["bm32", "bm64"])
@pytest.mark.parametrize("num_sms", [1, 7, 132, 188])
def test_every_work_unit_is_done_once_and_shares_are_equal(cap, config, num_sms):
    args = marshal(cap)
    H = cap.meta.num_heads
    p = plan(args, H, num_sms, config)
    a = {k: v.numpy() for k, v in p.arrays.items()}
    n = cap.num_draft.numpy()
    kv = (cap.prefix_lens + cap.num_draft).numpy()
    row_tiles = -(-n * H // config.bm)
    assert len(a["rt_request"]) == row_tiles.sum() == p.row_tiles and p.grid <= num_sms
    shares = np.diff(a["cta_unit_start"])
    assert shares.min() >= 1 and shares.max() - shares.min() <= 1
    seen = {}
    slots = []
    for c, rt, k0, k1, slot in walk(p, config.bn):
        seen.setdefault(rt, []).append((k0, k1))
        if slot is not None:
            slots.append(slot)
    for rt, ranges in seen.items():
        b = a["rt_request"][rt]
        key_tiles = max(1, -(-kv[b] // config.bn))
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == key_tiles
        assert all(r0[1] == r1[0] for r0, r1 in zip(ranges, ranges[1:]))  # contiguous, no overlap
        split = len(ranges) > 1
        assert (a["rt_seg_base"][rt + 1] - a["rt_seg_base"][rt] > 0) == split
    assert len(seen) == len(a["rt_request"])
    assert sorted(slots) == list(range(p.segments))  # each partial slot written exactly once


@pytest.mark.parametrize("cap", CASES, ids=lambda c: f"bs{c.batch_size}-N{int(c.num_draft.max())}")
def test_fused_merge_only_for_short_splits(cap):
    args = marshal(cap)
    config = KernelConfig.for_arch("sm_90")
    for num_sms in (7, 132, 188):
        p = plan(args, cap.meta.num_heads, num_sms, config)
        segs = np.diff(p.arrays["rt_seg_base"].numpy())
        assert p.fused_merge == (p.segments > 0 and segs.max() <= FUSED_MERGE_SEGS)
        if segs.max() > FUSED_MERGE_SEGS:
            with pytest.raises(ValueError, match="fused merge"):
                plan(args, cap.meta.num_heads, num_sms, config, fused_merge=True)


def test_the_plan_takes_32_rows_for_small_batches_of_short_trees_and_64_otherwise():
    from kdtree.bench import CASES
    from kdtree.kernel import choose_plan

    configs = KernelConfig.candidates("sm_90")
    assert [c.bm for c in configs] == [64, 32] and KernelConfig.candidates("sm_120") == (KernelConfig(),)
    chosen = {}
    for case in CASES:
        cap = synthesize(case.spec(), reference=False)
        chosen[case.name] = choose_plan(marshal(cap), cap.meta.num_heads, 132, configs).config.bm
    assert chosen["kimi-tp8 small tree"] == chosen["kimi-tp8 ddtree64 4k"] == 32, chosen
    assert all(bm == 64 for name, bm in chosen.items() if any(s in name for s in ("8k x8", "32k", "128k", "kimi-dp"))), chosen
