import re

import torch

from kdtree.capture import load
from kdtree.diff import compare
from kdtree.impls import diff_capture
from kdtree.outputs import POISON_BITS, AttnOutput, poisoned
from kdtree.reference import oracle

from conftest import SHIPPED

LINE = re.compile(r"^\[kdtree\] L(\d+) max_abs_diff=\d\.\d{4}e[+-]\d\d mean=\d\.\d{4}e[+-]\d\d rel=\d\.\d{4}e[+-]\d\d")


def test_identical_outputs_pass_with_zero_error(tiny):
    ref = oracle(tiny, 0)
    d = compare(tiny, 0, AttnOutput(ref.o.clone(), ref.lse.clone()), ref)
    assert d.passed and d.rel == 0 and d.max_abs == 0 and d.lse_max_abs == 0
    assert LINE.match(d.line())


def test_unwritten_elements_are_counted_and_fail(tiny):
    ref = oracle(tiny, 0)
    o = ref.o.to(torch.bfloat16)
    o[5, 2, :100] = poisoned((100,))
    d = compare(tiny, 0, AttnOutput(o, None), ref)
    assert d.unwritten == 100 and d.nan == 0 and not d.passed
    assert "unwritten=100" in d.line()
    b = int(torch.searchsorted(tiny.qo_indptr.long(), torch.tensor(5), right=True)) - 1
    assert (d.worst["request"], d.worst["node"], d.worst["head"]) == (b, 5 - int(tiny.qo_indptr[b]), 2)


def test_computed_nans_are_told_apart_from_unwritten(tiny):
    ref = oracle(tiny, 0)
    o = ref.o.to(torch.bfloat16)
    o[0, 0, 0] = float("nan")
    d = compare(tiny, 0, AttnOutput(o, None), ref)
    assert d.nan == 1 and d.unwritten == 0 and not d.passed
    assert poisoned((1,)).view(torch.int16).item() == POISON_BITS


def test_worst_element_and_its_depth_are_located(tiny):
    ref = oracle(tiny, 0)
    o = ref.o.clone()
    t = int(tiny.qo_indptr[2]) + 7
    o[t, 5, 11] += 3.0
    d = compare(tiny, 0, AttnOutput(o, None), ref)
    assert d.worst["request"] == 2 and d.worst["node"] == 7 and d.worst["head"] == 5
    assert d.worst["depth"] == int(tiny.depths(2)[7])
    assert abs(d.max_abs - 3.0) < 1e-9
    assert d.per_request[2]["rel"] > 0 and d.per_request[0]["rel"] == 0


def test_planted_wrong_kernels_are_rejected():
    """Known-bad 'kernels' (KernelBench style): each must fail the diff."""
    cap = load(next(p for p in SHIPPED if "3layers" in p.name))
    a, b = cap.meta.layer_ids[:2]
    ref_b = oracle(cap, b)
    zeros = AttnOutput(torch.zeros_like(ref_b.o), None)
    stale = oracle(cap, a)  # another layer's result, cached
    nodes_swapped = AttnOutput(ref_b.o.roll(1, dims=0), None)
    heads_swapped = AttnOutput(ref_b.o.roll(1, dims=1), None)
    for bad in (zeros, stale, nodes_swapped, heads_swapped):
        assert not compare(cap, b, bad, ref_b).passed


def test_diff_capture_runs_every_layer():
    cap = load(next(p for p in SHIPPED if "3layers" in p.name))
    seen = []
    results = diff_capture(cap, "emulation", "oracle", device="cpu", on_layer=seen.append)
    assert [d.layer for d in results] == cap.meta.layer_ids == [d.layer for d in seen]
    assert all(d.passed for d in results)
