"""The CUDA kernel on a GPU: every shipped capture, 200 fuzz batches, faults, determinism, CUDA graphs.

Skipped (with the reason) where there is no CUDA GPU; `make test-gpu` runs them on one.
"""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from kdtree.capture import load
from kdtree.diff import compare
from kdtree.fuzz import fuzz_spec
from kdtree.impls import run_impl
from kdtree.marshal import FAULTS, marshal
from kdtree.outputs import AttnOutput, poisoned
from kdtree.reference import emulate_triton, oracle
from kdtree.synth import SynthSpec, synthesize

from conftest import FAULT_MARGIN, SHIPPED

pytestmark = pytest.mark.gpu
REL_BAR = 5e-3


@pytest.fixture(scope="module")
def kern():
    from kdtree.kernel import VerifyKernel

    return VerifyKernel.get()


def launched(kern, cap, args, p) -> AttnOutput:
    """Layer 0 of `cap` launched on host plan `p` (o poisoned and lse NaN first, so a row left out shows)."""
    from kdtree.kernel import Workspace

    p = p.to("cuda")
    o, lse = (
        poisoned((cap.num_tokens, cap.meta.num_heads, 512), "cuda"),
        torch.full((cap.num_tokens, cap.meta.num_heads), float("nan"), device="cuda"),
    )
    kern.launch(p, args.to("cuda"), cap.layer(0).q.cuda(), cap.pool(0, "cuda"), o, lse, Workspace.for_plan(p))
    return AttnOutput(o, lse)


def check_against_references(cap, lid, out):
    ref = oracle(cap, lid, device="cuda")
    emu = emulate_triton(cap, lid, device="cuda")
    d = compare(cap, lid, out, ref)
    d_emu = compare(cap, lid, emu, ref)
    assert d.nan == 0 and d.unwritten == 0, d.line()
    assert d.rel <= REL_BAR, d.line()
    assert d.max_abs <= 2 * d_emu.max_abs + 1e-6, f"{d.line()} vs emulation max_abs {d_emu.max_abs:.4e}"
    assert d.lse_max_abs is not None and d.lse_max_abs < 1e-2, d.line()
    return d


def test_merge_launches_give_the_same_bits(kern):
    """verify_mla_merge as a programmatic dependent or a plain launch, 64 or 128 threads a row, and with rows of
    more than 8 partials staged (the default) or loaded one at a time (`VMLA_MERGE_STAGED=0`): the same bits (the
    same sums in the same order), on a batch whose tiles split into up to 8 partials (registers) and more."""
    from kdtree.kernel import MERGE_THREADS, Workspace, pdl_available

    most_partials = []
    for seed in (3, 5):
        cap = synthesize(fuzz_spec(seed), device="cuda", reference=False)
        host_args = marshal(cap)
        args = host_args.to("cuda")
        q, pool = cap.layer(0).q.cuda(), cap.pool(0, "cuda")
        T, H = cap.num_tokens, cap.meta.num_heads
        p = kern.plan(host_args, H).to("cuda")
        if not p.split or p.fused_merge:
            continue
        most_partials.append(int((p.arrays["rt_seg_base"][1:] - p.arrays["rt_seg_base"][:-1]).max()))
        ws = Workspace.for_plan(p)
        outs = []
        for pdl in sorted({False, pdl_available()}):
            for threads in (64, 128):
                kern.pdl, kern.merge_threads = pdl, threads
                o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
                kern.launch(p, args, q, pool, o, lse, ws)
                outs.append((o.clone(), lse.clone()))
        kern.pdl, kern.merge_threads = pdl_available(), MERGE_THREADS
        one_at_a_time = dataclasses.replace(p, config=p.config.with_defines(("VMLA_MERGE_STAGED=0",)))
        kern.compiled(one_at_a_time.config)
        o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
        kern.launch(one_at_a_time, args, q, pool, o, lse, ws)
        outs.append((o.clone(), lse.clone()))
        torch.cuda.synchronize()
        assert len(outs) >= 2
        for o, lse in outs[1:]:
            assert torch.equal(o.view(torch.int16), outs[0][0].view(torch.int16))
            assert torch.equal(lse, outs[0][1])
    # the cases it is for: rows merged from registers (<= 8 partials) and staged or one at a time (more); on the H200's 132 SMs
    # seed 3 splits a tile into 28 partials and seed 5 into 3 (the plan is the host's: checked on CPU too)
    assert len(most_partials) == 2 and min(most_partials) <= 8 < max(most_partials), most_partials


@pytest.mark.parametrize("target", [None, "sm_120"], ids=["this-gpu", "sm_120-config"])
def test_shared_memory_size_agrees_with_the_source(target):
    import cupy

    from kdtree.kernel import KernelConfig, VerifyKernel

    k = VerifyKernel.get(KernelConfig.for_arch(target) if target else None)
    ptr = k.module.get_global("verify_mla_smem_bytes")
    value = cupy.ndarray((1,), dtype=cupy.int32, memptr=ptr).get()
    assert int(value[0]) == k.config.smem_bytes


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_capture(kern, path):
    cap = load(path)
    for lid in cap.meta.layer_ids:
        check_against_references(cap, lid, run_impl("cuda", cap, lid, device="cuda"))


@pytest.mark.parametrize("seed", range(200))
def test_fuzz(kern, seed):
    cap = synthesize(fuzz_spec(seed), device="cuda", reference=False)
    check_against_references(cap, 0, run_impl("cuda", cap, 0, device="cuda"))


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_faults_are_caught_through_the_kernel(kern, path, fault):
    cap = load(path)
    lid = cap.meta.layer_ids[0]
    d = compare(cap, lid, run_impl("cuda", cap, lid, fault=fault, device="cuda"), oracle(cap, lid, device="cuda"))
    assert d.rel > FAULT_MARGIN.get(path.stem, 10.0) * d.tolerance and not d.passed, d.line()  # as tests/test_marshal.py


def captured_launch(kern, p, args, q, pool, o, lse, ws) -> "torch.cuda.CUDAGraph":
    """The launch captured in a CUDA graph (after one warm-up launch outside the capture)."""
    from kdtree.serving import captured

    return captured(lambda: kern.launch(p, args, q, pool, o, lse, ws))


def test_deterministic_and_graph_replay_matches(kern):
    from kdtree.kernel import Workspace

    cap = synthesize(fuzz_spec(3), device="cuda", reference=False)  # a long prefix: split + merge path
    host_args = marshal(cap)
    args = host_args.to("cuda")
    q, pool = cap.layer(0).q.cuda(), cap.pool(0, "cuda")
    T, H = cap.num_tokens, cap.meta.num_heads
    p = kern.plan(host_args, H).to("cuda")
    assert p.split
    ws = Workspace.for_plan(p)
    outs = []
    for _ in range(2):
        o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
        kern.launch(p, args, q, pool, o, lse, ws)
        outs.append((o.clone(), lse.clone()))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
    assert torch.equal(outs[0][1], outs[1][1])
    o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
    g = captured_launch(kern, p, args, q, pool, o, lse, ws)
    o.view(torch.int16).fill_(0x7FA5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o.view(torch.int16), outs[0][0].view(torch.int16))


@pytest.mark.parametrize("target", [None, "sm_120"], ids=["this-gpu", "sm_120-config"])
def test_fused_merge_gives_the_merge_kernels_bits(target):
    """Where the plan allows it, the last block of a split tile merges it: the same bits as verify_mla_merge,
    counters back at zero afterwards (so a graph replay starts clean), and a graph replay gives the same bits."""
    from kdtree.bench import ANCHOR_CASES
    from kdtree.kernel import FUSED_MERGE_SEGS, KernelConfig, VerifyKernel, Workspace, plan

    kern = VerifyKernel.get(KernelConfig.for_arch(target) if target else None)
    caps = [load(p) for p in SHIPPED] + [synthesize(fuzz_spec(s), device="cuda", reference=False) for s in (1, 2, 5)]
    caps.append(synthesize(ANCHOR_CASES[0].spec(), device="cuda", reference=False))  # the small-tree bench case
    fused_runs = 0
    for cap in caps:
        host_args = marshal(cap)
        args = host_args.to("cuda")
        q, pool = cap.layer(cap.meta.layer_ids[0]).q.cuda(), cap.pool(cap.meta.layer_ids[0], "cuda")
        T, H = cap.num_tokens, cap.meta.num_heads
        for num_sms in (kern.num_sms, 37):
            outs = []
            for fused in (False, True):
                try:
                    p = plan(host_args, H, num_sms, kern.config, fused_merge=fused).to("cuda")
                except ValueError:  # a tile split into more than FUSED_MERGE_SEGS partials
                    break
                ws = Workspace.for_plan(p)
                o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
                kern.launch(p, args, q, pool, o, lse, ws)
                torch.cuda.synchronize()
                assert int(ws.rt_counter.abs().sum()) == 0
                outs.append((o, lse))
            if len(outs) == 2 and p.fused_merge:
                fused_runs += 1
                assert torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
                assert torch.equal(outs[0][1], outs[1][1])
    assert fused_runs >= 3, f"only {fused_runs} batches could take the fused merge (<= {FUSED_MERGE_SEGS} partials a tile)"
    # graph replay of a fused launch
    cap = caps[-1]
    host_args = marshal(cap)
    args = host_args.to("cuda")
    q, pool = cap.layer(0).q.cuda(), cap.pool(0, "cuda")
    T, H = cap.num_tokens, cap.meta.num_heads
    p = plan(host_args, H, kern.num_sms, kern.config, fused_merge=True).to("cuda")
    ws = Workspace.for_plan(p)
    o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
    kern.launch(p, args, q, pool, o, lse, ws)
    first = o.clone()
    g = captured_launch(kern, p, args, q, pool, o, lse, ws)
    for _ in range(3):
        o.view(torch.int16).fill_(0x7FA5)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(o.view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("target", ["sm_100", "sm_120", "sm_90a"], ids=["bm64-mma.sync", "sm_120-config", "wgmma"])
def test_restructured_loops_give_the_same_bits(target):
    """Switches that reorganise work without changing any sum's order must not change the output by a bit: the
    tree mask read key by key (VMLA_FAST_MASK=0, the default reads it as one bit word per thread), P.V in
    column groups of 4 n8 tiles, QK in two passes over a warp's keys (where they split evenly); on Hopper the
    wgmma segment whose warpgroups split a tile's dims, unpipelined (2 stages) and pipelined - on every shipped
    capture and fuzz batches with deep trees, long prefixes and keys past the end of a segment."""
    import dataclasses

    from kdtree.kernel import KernelConfig, VerifyKernel, device_arch

    base = KernelConfig.for_arch(target)  # mma.sync at 64 rows (what sm_100 runs) and at 32 rows; the wgmma segment
    if base.wgmma:
        if device_arch() != "sm_90":
            pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
        base = base.dims_split()
        others = [dataclasses.replace(base, stages=2, wg_pipe=0)]
    else:
        others = [
            dataclasses.replace(base, extra=(("VMLA_FAST_MASK", 0),)),
            dataclasses.replace(base, extra=(("VMLA_PV_GROUP", 4),)),
        ]
        if (base.bn // base.khalves // 8) % 4 == 0:
            others.append(dataclasses.replace(base, kpasses=2))
    kernels = [VerifyKernel.get(c) for c in [base, *others]]
    caps = [load(p) for p in SHIPPED] + [synthesize(fuzz_spec(s), device="cuda", reference=False) for s in range(0, 40, 3)]
    for cap in caps:
        lid = cap.meta.layer_ids[0]
        args, q, pool = marshal(cap), cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        o1, l1 = kernels[0].run(args, q, pool)
        for kern in kernels[1:]:
            o2, l2 = kern.run(args, q, pool)
            assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)) and torch.equal(l1, l2), kern.config


@pytest.mark.parametrize("body", ["mma32", "split_keys+few", "blocks64"])
def test_the_order_of_a_blocks_segments_changes_no_bits(body):
    """A block runs its last segment first (`KernelConfig.last_segment_first`): the sm_120 configuration and the
    two Hopper configurations the bench cases run, each on its plans at the full grid (tiles split across
    blocks; the fused merge on the mma.sync body, the merge kernel on wgmma), give the bits of the same kernel
    built to run its segments in unit order - on every shipped capture, fuzz batches, a batch whose blocks
    each work on two row tiles and one of short and long requests (blocks with several short segments). o
    starts poisoned and lse NaN, so a segment left out shows."""
    from kdtree.kernel import KernelConfig, VerifyKernel, Workspace, device_arch, plan

    hopper = KernelConfig.candidates("sm_90")
    config = {"mma32": KernelConfig(), "split_keys+few": hopper[0], "blocks64": hopper[1]}[body]
    assert config.body == body
    if config.wgmma and device_arch() != "sm_90":
        pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
    caps = [load(p) for p in SHIPPED] + [synthesize(fuzz_spec(s), device="cuda", reference=False) for s in range(1, 40, 6)]
    caps += [
        synthesize(
            SynthSpec(preset=preset, batch_size=bs, prefix_lens=[n], budget=budget, seed=2), device="cuda", reference=False
        )
        for preset, bs, n, budget in (("deepseek-v3-tp8", 2, 2000, 256), ("kimi-k2-tp8", 8, 1500, 64))
    ]
    mixed = SynthSpec(preset="kimi-k2-tp8", batch_size=4, prefix_lens=[100, 3, 1500, 700], budget=64, seed=2)
    caps.append(synthesize(mixed, device="cuda", reference=False))  # short requests' row tiles, several a block
    reordered = 0
    kernels = [VerifyKernel.get(c) for c in (config, config.in_unit_order())]
    for cap in caps:
        lid = cap.meta.layer_ids[0]
        host_args = marshal(cap)
        args, q, pool = host_args.to("cuda"), cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        T, H = cap.num_tokens, cap.meta.num_heads
        p = plan(host_args, H, kernels[0].num_sms, config)
        reordered += int((p.block_segments > 1).any())
        outs = []
        for kern in kernels:
            kp = dataclasses.replace(p, config=kern.config).to("cuda")
            kern.compiled(kern.config)
            o, lse = poisoned((T, H, 512), "cuda"), torch.full((T, H), float("nan"), device="cuda")
            kern.launch(kp, args, q, pool, o, lse, Workspace.for_plan(kp))
            outs.append((o, lse))
        (o1, l1), (o2, l2) = outs
        assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)) and torch.equal(l1, l2), (config, cap.meta)
    assert reordered >= 6, f"only {reordered} of {len(caps)} plans had a block with several segments"


@pytest.mark.parametrize("target", ["sm_120", "sm_90a", "sm_90a-no-few"])
def test_row_tiles_ending_at_their_last_visible_key_give_the_same_bits(target):
    """A row tile's draft keys past the last one its rows may see add exact zeros: with one block walking every
    row tile whole (grid 1, no splits), the plan that leaves them out (`visible_keys`, the default) gives the
    bits of the plan over all keys - on every shipped capture and fuzz batches with deep trees - and leaves
    keys out on most of them; the default plan at the full grid passes the oracle bar on them too."""
    import dataclasses

    from kdtree.kernel import KernelConfig, VerifyKernel, Workspace, device_arch, plan

    config = KernelConfig.for_arch(target.removesuffix("-no-few"))
    if config.wgmma and device_arch() != "sm_90":
        pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
    if target.endswith("-no-few"):
        config = dataclasses.replace(config, few_rows=0)
    kern = VerifyKernel.get(config)
    caps = [load(p) for p in SHIPPED] + [synthesize(fuzz_spec(s), device="cuda", reference=False) for s in range(2, 60, 5)]
    fewer = 0
    for cap in caps:
        lid = cap.meta.layer_ids[0]
        host_args = marshal(cap)
        args, q, pool = host_args.to("cuda"), cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        T, H = cap.num_tokens, cap.meta.num_heads
        outs = []
        for visible in (True, False):
            p = plan(host_args, H, 1, config, visible_keys=visible).to("cuda")
            o, lse = poisoned((T, H, 512), "cuda"), torch.empty(T, H, device="cuda")
            kern.launch(p, args, q, pool, o, lse, Workspace.for_plan(p))
            outs.append((o, lse, p.units))
        assert torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16)) and torch.equal(outs[0][1], outs[1][1])
        fewer += outs[0][2] < outs[1][2]
        o, lse = kern.run(host_args, q, pool)
        check_against_references(cap, lid, AttnOutput(o, lse))
    assert fewer >= len(caps) // 2, f"only {fewer} of {len(caps)} batches had keys to leave out"


@pytest.mark.parametrize("seed", range(0, 200, 4))
@pytest.mark.parametrize("target", ["sm_120", "sm_90a", "sm_90a-blocks64"])
def test_one_configuration_alone(monkeypatch, target, seed):
    """Each configuration on every batch, not only those the cost model gives it: the kernel sm_120 runs
    (mma.sync, 32 rows, Q in registers, < 99 KB) and, on Hopper, split_keys (64 rows, few-row tiles) and
    blocks64 - every shipped capture (seed 0) and every fourth fuzz batch."""
    from kdtree.kernel import KernelConfig, VerifyKernel, device_arch

    if target.startswith("sm_90a") and device_arch() != "sm_90":
        pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
    monkeypatch.setenv("KDTREE_KERNEL_TARGET", target)
    assert VerifyKernel.get().configs == (KernelConfig.for_arch(target),)
    if seed == 0:
        for path in SHIPPED:
            cap = load(path)
            for lid in cap.meta.layer_ids:
                check_against_references(cap, lid, run_impl("cuda", cap, lid, device="cuda"))
    cap = synthesize(fuzz_spec(seed), device="cuda", reference=False)
    check_against_references(cap, 0, run_impl("cuda", cap, 0, device="cuda"))


@pytest.mark.parametrize("seed", range(0, 200, 8))
def test_64_rows_with_q_in_registers(seed):
    """The mma.sync body on 64 rows in sm_120's limits (`KernelConfig.rows64_in_registers`: 16-key tiles in 4
    stages, Q staged through all of them and then held in registers, swizzled partial scores) passes the oracle
    bar on every shipped capture (seed 0) and every eighth fuzz batch, over its plans at the full grid (split
    tiles, the fused merge)."""
    from kdtree.kernel import KernelConfig, VerifyKernel

    kern = VerifyKernel.get(KernelConfig.rows64_in_registers())
    caps = [load(p) for p in SHIPPED] if seed == 0 else []
    caps.append(synthesize(fuzz_spec(seed), device="cuda", reference=False))
    for cap in caps:
        for lid in cap.meta.layer_ids[:2]:
            host_args, q, pool = marshal(cap), cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
            o, lse = kern.run(host_args, q, pool)
            check_against_references(cap, lid, AttnOutput(o, lse))


@pytest.mark.parametrize("few_rows", [0, 16], ids=["64-row-wgmma", "few-row-segment"])
def test_few_row_tiles_in_either_segment(few_rows):
    """On Hopper a row tile of at most 16 rows (a request's last: node 16 x 8 heads of the small tree) runs the
    mma.sync few-row segment; with few_rows 0 the 64-row wgmma segment runs it. Both pass the oracle bar on every
    shipped capture (most have such tiles, split and whole) and on fuzz batches, the logit cap included, and
    agree with each other to bf16 rounding."""
    import dataclasses

    from kdtree.kernel import KernelConfig, VerifyKernel, device_arch

    if device_arch() != "sm_90":
        pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
    kern = VerifyKernel.get(dataclasses.replace(KernelConfig.for_arch("sm_90a"), few_rows=few_rows))
    other = VerifyKernel.get(dataclasses.replace(KernelConfig.for_arch("sm_90a"), few_rows=16 - few_rows))
    caps = [load(p) for p in SHIPPED] + [synthesize(fuzz_spec(s), device="cuda", reference=False) for s in range(1, 60, 6)]
    caps.append(synthesize(SynthSpec(batch_size=3, prefix_lens=[700, 40, 0], budget=17, seed=8, logit_cap=5.0), device="cuda"))
    few_tiles = 0
    for cap in caps:
        lid = cap.meta.layer_ids[0]
        args, q, pool = marshal(cap), cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        T, H = cap.num_tokens, cap.meta.num_heads
        last = (cap.num_draft * H) % 64  # rows of each request's last row tile (0: a full one)
        few_tiles += int(((last > 0) & (last <= 16)).sum())
        o, lse = poisoned((T, H, 512), "cuda"), torch.full((T, H), float("nan"), device="cuda")
        kern.run(args, q, pool, o, lse)
        check_against_references(cap, lid, AttnOutput(o, lse))
        o2, lse2 = other.run(args, q, pool)
        assert float((o.float() - o2.float()).norm() / o2.float().norm()) < 5e-3
        assert float((lse - lse2).abs().max()) < 1e-3
    assert few_tiles > 20  # the batches do have few-row tiles


def test_split_keys_and_dims_split_bodies_agree():
    """The Hopper bodies split_keys (each warpgroup on its own 32-key tile of a 64-key step, the default) and
    dims_split (the two splitting one tile's dims, partial scores exchanged) both pass the oracle bar and agree to
    bf16 rounding, on every shipped capture, fuzz batches (stream-K segments of odd tile counts end on a zero-filled second tile)
    and requests of 0, 5, 31, 33 and 64 prefix keys."""

    from kdtree.kernel import KernelConfig, VerifyKernel, device_arch

    if device_arch() != "sm_90":
        pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
    split = KernelConfig.for_arch("sm_90a")
    assert split.split_keys
    kern = VerifyKernel.get(split)
    dims = VerifyKernel.get(split.dims_split())
    caps = [load(p) for p in SHIPPED] + [synthesize(fuzz_spec(s), device="cuda", reference=False) for s in range(2, 60, 6)]
    caps.append(synthesize(SynthSpec(batch_size=5, prefix_lens=[0, 5, 31, 33, 64], budget=9, seed=3), device="cuda"))
    for cap in caps:
        lid = cap.meta.layer_ids[0]
        args, q, pool = marshal(cap), cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        T, H = cap.num_tokens, cap.meta.num_heads
        o, lse = poisoned((T, H, 512), "cuda"), torch.full((T, H), float("nan"), device="cuda")
        kern.run(args, q, pool, o, lse)
        check_against_references(cap, lid, AttnOutput(o, lse))
        o2, lse2 = dims.run(args, q, pool)
        check_against_references(cap, lid, AttnOutput(o2, lse2))
        assert float((o.float() - o2.float()).norm() / o2.float().norm()) < 5e-3
        assert float((lse - lse2).abs().max()) < 1e-3


def test_logit_cap_is_supported(kern):
    cap = synthesize(SynthSpec(batch_size=2, prefix_lens=[300, 5], budget=16, seed=4, logit_cap=5.0), device="cuda")
    check_against_references(cap, 0, run_impl("cuda", cap, 0, device="cuda"))


def test_one_row_tile_a_block(kern):
    """A batch of fewer equal row tiles than blocks (2 x 4,112 rows of DeepSeek-V3: 130 tiles of 64), planned as
    over L2 (one tile a block, the other blocks idle, nothing split), against the references."""
    from kdtree.kernel import choose_plan

    cap = synthesize(
        SynthSpec(preset="deepseek-v3-tp8", batch_size=2, prefix_lens=[2000, 2000], budget=256, seed=2), device="cuda"
    )
    args, H = marshal(cap), cap.meta.num_heads
    p = choose_plan(args, H, kern.num_sms, kern.configs, l2_bytes=1)
    if p.row_tiles >= kern.num_sms:
        pytest.skip(f"{kern.num_sms} SMs: no idle block for {p.row_tiles} row tiles")
    assert p.grid == p.row_tiles and p.segments == 0, (p.grid, p.row_tiles, p.segments)
    kern.compiled(p.config)
    check_against_references(cap, 0, launched(kern, cap, args, p))


def test_a_long_request_cut_alike(kern):
    """The bench's mixed batch (prefixes of 3 to 45,000 keys, N 65), on this GPU's candidates: on Hopper the cost
    model takes the aligned plan on blocks64 (the 45,000-key request's nine row tiles cut at the same key
    offsets, the other requests balanced with a segment weighed ALIGN_SEGMENT_UNITS), against the references."""
    from kdtree.bench import ANCHOR_CASES
    from kdtree.kernel import device_arch

    if device_arch() != "sm_90":
        pytest.skip(f"blocks64, and so aligned plans, are Hopper's; this GPU is {device_arch()}")
    cap = synthesize(next(c for c in ANCHOR_CASES if c.name == "kimi-tp8 mixed").spec(), device="cuda")
    args, H = marshal(cap), cap.meta.num_heads
    p = kern.plan(args, H)
    assert p.aligned and p.config.blocks64
    check_against_references(cap, 0, launched(kern, cap, args, p))


def test_flashinfer_on_chains_agrees_with_the_oracle_and_the_kernel(kern):
    """FlashInfer's causal MLA kernel (kdtree.flashinfer_mla, where FlashInfer imports) on chain drafts: against the
    fp64 oracle as the kernel is held, and against the kernel itself (an independent implementation of the same
    attention from the same marshaled slot list and pool)."""
    from kdtree.flashinfer_mla import causal_step, load

    flashinfer, what = load()
    if flashinfer is None:
        pytest.skip(f"FlashInfer {what}")
    cap = synthesize(
        SynthSpec(batch_size=3, prefix_lens=[700, 33, 2100], tree="chain", num_draft_tokens=16, seed=5), device="cuda"
    )
    lid = cap.meta.layer_ids[0]
    args = marshal(cap)
    q, pool = cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
    step, o, info = causal_step(cap, args, q, pool, flashinfer)
    o.zero_()
    step(q, pool)
    torch.cuda.synchronize()
    ref = oracle(cap, lid, device="cuda")
    d = compare(cap, lid, AttnOutput(o.clone(), None), ref)
    assert d.nan == 0 and d.rel <= REL_BAR, f"FlashInfer {info['backend']}: {d.line()}"
    ours = run_impl("cuda", cap, lid, device="cuda")
    rel = float((ours.o.double() - o.double()).norm() / o.double().norm())
    assert rel <= REL_BAR, f"kdtree vs FlashInfer {info['backend']}: rel {rel:.2e}"


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize(
    "capture,target,pdl",
    [("mixed", None, "0"), ("mixed", None, "1"), ("ddtree64-bs3", "sm_120", "0"), ("mixed", "sm_90a", "1")],
    ids=["mixed", "mixed-pdl", "fused-merge", "split_keys"],
)
def test_compute_sanitizer_is_clean(tool, capture, target, pdl):
    """On a small batch, the merge after a plain launch and as a programmatic dependent (the cost model runs the
    32-row body there); the third takes the fused merge (sm_120's configuration splits that batch so); the
    fourth runs the Hopper split_keys body (skipped elsewhere). The blocks64 body is not here: racecheck
    reports hazards on its bar.arrive hand-overs that it also reports on correct code (tools/racecheck_probe.py,
    docs/kernel-design.md, "racecheck on the 64-key-block body")."""
    from kdtree.kernel import device_arch

    if target == "sm_90a" and device_arch() != "sm_90":
        pytest.skip(f"the wgmma segment needs Hopper (sm_90), this GPU is {device_arch()}")
    small = next(p for p in SHIPPED if capture in p.name)
    env = os.environ | {"KDTREE_PDL": pdl} | ({"KDTREE_KERNEL_TARGET": target} if target else {})
    r = subprocess.run(
        [
            "compute-sanitizer",
            f"--tool={tool}",
            "--error-exitcode=99",
            sys.executable,
            "-m",
            "kdtree",
            "diff",
            str(small),
            "--impl",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "ERROR SUMMARY: 0 errors" in out or "(0 errors, 0 warnings)" in out, out[-3000:]


def test_sglang_reference_path():
    """SGLang's Triton kernel, called as kdtree calls it, lands at its known error floor, and the kernel
    agrees with it (skipped where SGLang does not import)."""
    from kdtree.sglang import extend_attention

    fn, why = extend_attention()
    if fn is None:
        pytest.skip(f"SGLang not importable: {why}")
    cap = synthesize(SynthSpec(batch_size=3, prefix_lens=[0, 700, 2500], budget=32, seed=21), device="cuda", reference="sglang")
    assert cap.meta.reference.startswith("sglang:") and cap.layer(0).lse is None
    d = compare(cap, 0, run_impl("capture", cap, 0, device="cuda"), oracle(cap, 0, device="cuda"))
    assert d.passed and d.rel < 5e-3, d.line()
    assert compare(cap, 0, run_impl("cuda", cap, 0, device="cuda"), run_impl("capture", cap, 0, device="cuda")).rel < 5e-3
