"""The chain bench's plumbing on the CPU: chain variants of the bench cases, the causal mask FlashInfer runs against
the chain's tree mask, what `kdtree.flashinfer_mla` refuses, and the summary's FlashInfer columns. (FlashInfer
itself runs in tests/test_kernel_gpu.py, where it imports.)"""

import json
import math
import sys

import pytest
import torch

from kdtree.bench import BENCH_CASES, BenchCase, geomean, summary_table
from kdtree.flashinfer_mla import causal_step, is_chain, load
from kdtree.marshal import marshal
from kdtree.reference import oracle
from kdtree.synth import synthesize

from conftest import ROOT

SMALL = BenchCase("small", "kimi-k2-tp8", (40, 7, 130), 9)


def test_chain_variants_keep_the_shape_and_change_the_tree():
    chain = SMALL.as_chain()
    assert (chain.name, chain.prefix_lens, chain.num_draft, chain.chain) == ("small chain", SMALL.prefix_lens, 9, True)
    cap, tree = synthesize(chain.spec(), reference=False), synthesize(SMALL.spec(), reference=False)
    assert cap.num_draft.tolist() == tree.num_draft.tolist() == [9, 9, 9]
    assert is_chain(cap) and not is_chain(tree)
    n1 = next(c for c in BENCH_CASES if c.num_draft == 1)
    assert n1.as_chain().name == n1.name  # one token a request is a chain already
    assert chain.as_chain() == chain  # and a chain stays one


def test_kdtree_is_related_to_each_baseline_that_ran():
    """bench.relate: rel against SGLang's output (else torch's) and against FlashInfer's, speedups over those with a
    time; nothing for a baseline that failed."""
    from kdtree.bench import relate

    want = torch.ones(4, 2, 512)
    outs = {"kdtree": want * 1.01, "torch": want, "flashinfer": want * 0.98}
    impls = {"kdtree": {"ms": 2.0}, "torch": {"ms": 9.0}, "flashinfer": {"ms": 3.0}, "sglang": {"error": "no"}}
    relate(impls, outs)
    k = impls["kdtree"]
    assert k["rel_vs_torch"] == pytest.approx(0.01) and k["rel_vs_flashinfer"] == pytest.approx(0.03 / 0.98)
    assert k["speedup_vs_flashinfer"] == pytest.approx(1.5) and "speedup_vs_sglang" not in k and "rel_vs_sglang" not in k
    outs["sglang"], impls["sglang"] = want * 1.02, {"ms": 8.0}
    relate(impls, outs)
    assert impls["kdtree"]["rel_vs_sglang"] == pytest.approx(0.01 / 1.02) and impls["kdtree"]["speedup_vs_sglang"] == 4.0
    failed = {"kdtree": {"error": "x"}}
    relate(failed, {"torch": want})
    assert failed == {"kdtree": {"error": "x"}}


def causal_attention(cap, lid):
    """fp64 attention with FlashInfer's causal mask over what it is given: request b's keys are the pool rows of its
    combined slot list (prefix ++ drafts, page size 1), and draft node i sees its prefix and drafts 0..i."""
    args, pool, H = marshal(cap), cap.pool(lid).double(), cap.meta.num_heads
    q, o = cap.layer(lid).q.double(), torch.empty(cap.num_tokens, H, 512, dtype=torch.float64)
    for b in range(cap.batch_size):
        q0, n, p = int(args.qo_indptr[b]), int(cap.num_draft[b]), int(cap.prefix_lens[b])
        keys = pool[args.combined_kv_indices[args.combined_kv_indptr[b] : args.combined_kv_indptr[b + 1]].long(), 0]
        s = torch.einsum("nhd,kd->nhk", q[q0 : q0 + n], keys) * float(cap.meta.sm_scale)
        causal = torch.ones(n, p + n, dtype=torch.bool).tril(p)
        o[q0 : q0 + n] = torch.softmax(s.masked_fill(~causal[:, None, :], -math.inf), -1) @ keys[:, :512]
    return o


def test_the_premise_a_causal_mask_over_the_slot_list_is_the_chain_tree_mask():
    """What the bench relies on, checked on its own: attention with FlashInfer's causal mask, over the combined slot
    list as its page list (what `causal_step` gives it), is the fp64 oracle's (which reads the capture's tree mask)
    on a chain, and not on a tree."""
    chain, tree = (synthesize(c.spec(), reference=False) for c in (SMALL.as_chain(), SMALL))
    lid = chain.meta.layer_ids[0]
    assert torch.allclose(causal_attention(chain, lid), oracle(chain, lid).o, rtol=0, atol=1e-12)
    assert not torch.allclose(causal_attention(tree, lid), oracle(tree, lid).o, rtol=0, atol=1e-3)


def test_a_tree_is_refused_before_flashinfer_is_needed():
    cap = synthesize(SMALL.spec(), reference=False)
    with pytest.raises(ValueError, match="chain"):
        causal_step(cap, marshal(cap), None, None, flashinfer=None)


def test_load_says_why_flashinfer_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # what an environment without it looks like to import
    module, what = load()
    assert module is None and what.startswith("not importable: ") and "flashinfer" in what


def test_the_summary_has_flashinfer_columns_where_it_ran():
    result = json.loads((ROOT / "tests/fixtures/bench-h200.json").read_text())
    assert "x fi" not in summary_table(result)
    timed = result["cases"][:3]
    for i, c in enumerate(timed):
        c["impls"]["flashinfer"] = {"ms": 2.0 * (i + 1) * c["impls"]["kdtree"]["ms"], "backend": "fa3"}
        c["impls"]["kdtree"]["speedup_vs_flashinfer"] = 2.0 * (i + 1)
    result["cases"][3]["impls"]["flashinfer"] = {"error": "RuntimeError: no FlashInfer MLA backend ran"}
    result["geomean_speedup_vs_flashinfer"] = geomean([2.0, 4.0, 6.0])
    lines = summary_table(result).splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("case")) - 1 :]  # [a header line, columns, rows]
    assert table[1].split()[-6:] == ["fi", "ms", "x", "fi", "fi", "backend"]
    for c, line in zip(timed, table[2:]):
        assert line.split()[-3:] == [
            f"{c['impls']['flashinfer']['ms']:.3f}",
            f"{c['impls']['kdtree']['speedup_vs_flashinfer']:.2f}",
            "fa3",
        ]
    assert table[5].split()[-3:] == ["-", "-", "error"] and table[6].split()[-3:] == ["-", "-", "-"]
    assert table[-1] == f"geomean speedup over FlashInfer (causal, chain drafts) on 3 cases: {48 ** (1 / 3):.2f}x"
