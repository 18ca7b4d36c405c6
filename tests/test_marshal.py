import numpy as np
import pytest
import torch

from kdtree.capture import load
from kdtree.diff import compare
from kdtree.impls import run_impl
from kdtree.marshal import FAULTS, marshal, pack_bits, unpack_bits
from kdtree.model import kernel_model
from kdtree.reference import oracle

from conftest import FAULT_MARGIN, SHIPPED


def test_pack_bits_round_trip():
    rng = np.random.default_rng(0)
    for n in (1, 31, 32, 33, 64, 257, 1025):
        block = rng.random((5, n)) < 0.5
        words = pack_bits(block, (n + 31) // 32)
        assert words.dtype == np.int32
        assert torch.equal(unpack_bits(torch.from_numpy(words), n), torch.from_numpy(block))
    # bit j of word j // 32, little-endian: node 33 is bit 1 of word 1
    one = np.zeros((1, 40), dtype=bool)
    one[0, 33] = True
    assert pack_bits(one, 2).tolist() == [[0, 2]]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_marshaling_builds_the_combined_key_list_and_the_tree_bits(path):
    cap = load(path)
    args = marshal(cap)
    kvp = args.combined_kv_indptr.long()
    for b in range(cap.batch_size):
        want = list(cap.prefix_slots(b).tolist()) + list(cap.draft_slots(b).tolist())
        assert args.combined_kv_indices[kvp[b] : kvp[b + 1]].tolist() == want
        assert int(args.prefix_lens[b]) == int(cap.prefix_lens[b])
        q0, q1 = int(cap.qo_indptr[b]), int(cap.qo_indptr[b + 1])
        n = q1 - q0
        assert torch.equal(unpack_bits(args.tree_mask[q0:q1], n), cap.tree_block(b))
        step = args.steps[b]
        assert step.mask_row_stride == int(cap.prefix_lens[b]) + n
    assert args.max_kv_len == int((cap.prefix_lens + cap.num_draft).max())


def test_faults_change_what_the_kernel_would_see():
    cap = load(next(p for p in SHIPPED if "ddtree64" in p.name))
    only = marshal(cap, "prefix-only-kv")
    assert torch.equal(only.combined_kv_indices.long(), cap.kv_indices.long())
    stride = marshal(cap, "prefix-stride")
    for b in range(cap.batch_size):
        assert stride.steps[b].mask_row_stride == int(cap.prefix_lens[b])
        assert not torch.equal(stride.steps[b].tree_block, cap.tree_block(b))
    with pytest.raises(ValueError, match="unknown fault"):
        marshal(cap, "off-by-one")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_kernel_model_is_at_the_bf16_floor_on_every_shipped_capture(path):
    cap = load(path)
    for lid in cap.meta.layer_ids:
        d = compare(cap, lid, run_impl("model", cap, lid, device="cpu"), oracle(cap, lid))
        assert d.passed and d.rel <= 5e-3, d.line()
        assert d.lse_max_abs < 1e-3


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_diff_catches_both_historical_bugs_on_every_shipped_capture(path, fault):
    # at least FAULT_MARGIN x the tolerance: 0.023-0.029 on server-chain16, 0.16-0.18 on sglang-chain16, above 0.5
    # on the synthetic captures
    cap = load(path)
    margin = FAULT_MARGIN.get(path.stem, 10.0)
    for lid in cap.meta.layer_ids:
        d = compare(cap, lid, run_impl("model", cap, lid, fault=fault, device="cpu"), oracle(cap, lid))
        assert d.rel > margin * d.tolerance and not d.passed, f"{fault}: {d.line()}"


def test_a_kernel_reading_a_wrong_slot_shows_nan(tiny):
    args = marshal(tiny)
    unused = next(s for s in range(1, tiny.meta.pool_size) if s not in set(tiny.kv_buffer_slots.tolist()))
    args.combined_kv_indices[3] = unused  # one prefix key of request 0... or later: whichever request owns entry 3
    out = kernel_model(args, tiny.layer(0).q, tiny.pool(0))
    d = compare(tiny, 0, out, oracle(tiny, 0))
    assert d.nan > 0 and not d.passed


def test_inject_is_refused_for_implementations_that_do_not_marshal(tiny):
    with pytest.raises(ValueError, match="marshaled"):
        run_impl("oracle", tiny, 0, fault="prefix-stride")
