import dataclasses
import time

import pytest
import torch

from kdtree.capture import CaptureError, load, save
from kdtree.synth import SynthSpec, synthesize

from conftest import SHIPPED, sha, small, write_raw


def test_shipped_captures_load_and_fit_the_size_budget():
    assert len(SHIPPED) >= 6
    assert sum(p.stat().st_size for p in SHIPPED) <= 40e6
    kinds = {p.stem: load(p).meta.source["kind"] for p in SHIPPED}
    assert {k for k, v in kinds.items() if v == "sglang"} == {"server-ngram16", "server-chain16", "sglang-chain16"}
    assert set(kinds.values()) == {"sglang", "synthetic"}


def test_shipped_captures_cover_the_cases_the_issue_names():
    caps = [load(p) for p in SHIPPED]
    algos = {c.meta.spec_algorithm for c in caps}
    assert {"EAGLE", "NGRAM", "DDTREE"} <= algos
    from_sglang = [c for c in caps if c.meta.source["kind"] == "sglang"]
    assert any(c.meta.reference.startswith("sglang:triton") and c.meta.sm_scale == 0.130861 for c in from_sglang)
    # a tree with branches and a causal chain, both from a live server (pages of 16 for the chain)
    live = [c for c in from_sglang if c.meta.spec_algorithm == "NGRAM"]
    assert any(
        c.meta.page_size == 16 and bool((c.tree_block(0) == torch.tril(torch.ones_like(c.tree_block(0)))).all()) for c in live
    )
    assert any(not bool((c.tree_block(0) == torch.tril(torch.ones_like(c.tree_block(0)))).all()) for c in live)
    assert any(bool((c.tree_block(0) == torch.tril(torch.ones_like(c.tree_block(0)))).all()) for c in from_sglang)
    assert any(not bool((c.tree_block(0) == torch.tril(torch.ones_like(c.tree_block(0)))).all()) for c in from_sglang)
    assert any(c.meta.tree_budget == 256 for c in caps)
    assert any(c.meta.tree_budget == 64 and c.batch_size > 1 and int(c.prefix_lens.min()) >= 1000 for c in caps)
    assert any({0, 1} <= set(c.prefix_lens.tolist()) for c in caps)
    assert any(c.meta.num_heads == 64 for c in caps)
    assert any(len(c.meta.layer_ids) > 1 for c in caps)


def test_round_trip_is_bit_exact(tmp_path, tiny):
    p = save(tiny, tmp_path / "a.safetensors")
    back = load(p)
    assert back.meta == tiny.meta
    a, b = tiny.tensor_dict(), back.tensor_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert torch.equal(
            a[k].view(torch.uint8) if a[k].dtype != torch.bool else a[k],
            b[k].view(torch.uint8) if b[k].dtype != torch.bool else b[k],
        ), k
    # saving what was loaded reproduces the file byte for byte
    save(back, tmp_path / "b.safetensors")
    assert sha(tmp_path / "a.safetensors") == sha(tmp_path / "b.safetensors")


def test_synth_is_deterministic_per_seed(tmp_path):
    a = save(small(seed=5), tmp_path / "a.safetensors")
    b = save(small(seed=5), tmp_path / "b.safetensors")
    c = save(small(seed=6), tmp_path / "c.safetensors")
    assert sha(a) == sha(b) != sha(c)


def test_loading_is_lazy_and_fast(tmp_path):
    cap = synthesize(SynthSpec(batch_size=4, prefix_lens=[20000], budget=64, seed=1))
    p = save(cap, tmp_path / "big.safetensors")
    assert p.stat().st_size > 100e6
    t0 = time.perf_counter()
    back = load(p)
    took = time.perf_counter() - t0
    assert took < 10.0, (
        f"opening a {p.stat().st_size / 1e6:.0f} MB capture took {took:.2f} s"
    )  # a generous bound: laziness is asserted next
    assert "layers.0.o" not in back._tensors._cache  # outputs are read only when asked for
    assert torch.equal(back.layer(0).o.view(torch.int16), cap.layer(0).o.view(torch.int16))


def test_pool_rebuild_keeps_slot_numbers_and_poisons_the_rest(tiny):
    from kdtree.capture import POOL_SLACK

    pool = tiny.pool(0)
    top = int(tiny.kv_buffer_slots.max()) + 1
    assert pool.shape == (min(tiny.meta.pool_size + tiny.meta.page_size, top + POOL_SLACK), 1, 576) == (tiny.pool_rows(), 1, 576)
    slots = tiny.kv_buffer_slots.long()
    assert torch.equal(pool[slots].view(torch.int16), tiny.layer(0).kv_buffer_rows.view(torch.int16))
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.isnan(pool[others].float()).all()
    assert bool(others[0])  # slot 0 (padding) is never referenced
    # draft keys sit at out_cache_loc
    assert torch.equal(pool[tiny.out_cache_loc].view(torch.int16), tiny.layer(0).k.view(torch.int16))


def test_save_is_atomic(tmp_path, tiny, monkeypatch):
    target = tmp_path / "cap.safetensors"
    save(tiny, target)
    before = sha(target)
    import kdtree.capture as capmod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(capmod, "save_file", boom)
    with pytest.raises(OSError):
        save(tiny, target)
    assert sha(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["cap.safetensors"]  # no temporary left behind


# ----- bad captures ------------------------------------------------------------------------------


def _break(tiny, what):
    """(tensors, meta_json, version) of a capture broken in one way."""
    t = {k: v.clone() for k, v in tiny.tensor_dict().items()}
    meta, version = tiny.meta, 1
    P = tiny.prefix_lens.tolist()
    if what == "wrong dtype":
        t["layers.0.q"] = t["layers.0.q"].to(torch.float16)
    elif what == "non-monotone indptr":
        t["kv_indptr"][1] = t["kv_indptr"][2] + 1
    elif what == "index out of range":
        t["kv_indices"][3] = tiny.meta.pool_size + 7
    elif what == "mask too short":
        t["custom_mask"] = t["custom_mask"][:-5]
    elif what == "out_cache_loc overlaps prefix":
        t["out_cache_loc"][2] = t["kv_indices"][0]
    elif what == "NaN in q":
        t["layers.0.q"][4, 1, 7] = float("nan")
    elif what == "missing tensor":
        del t["layers.0.o"]
    elif what == "unknown format version":
        version = 7
    elif what == "non-topological tree":
        b = 2  # request 2: make node 1 see node 3
        start = int(tiny.mask_indptr[b])
        n = int(tiny.num_draft[b])
        t["custom_mask"][start + 1 * (P[b] + n) + P[b] + 3] = True
    elif what == "not a tree":
        b = 2  # node 5 also sees a node that is not its ancestor
        par = tiny.parents(b)
        n = int(tiny.num_draft[b])
        i = n - 1
        anc = set()
        j = i
        while j >= 0:
            anc.add(j)
            j = int(par[j])
        extra = next(j for j in range(1, i) if j not in anc)
        t["custom_mask"][int(tiny.mask_indptr[b]) + i * (P[b] + n) + P[b] + extra] = True
    elif what == "slot 0 used":
        t["out_cache_loc"][0] = 0
    elif what == "pool row differs from k":
        slots = t["kv_buffer_slots"]
        row = int(torch.searchsorted(slots, t["out_cache_loc"][1]))
        t["layers.0.kv_buffer"][row, 0, 3] += 1
    elif what == "seq_lens disagree":
        t["seq_lens"][1] += 1
    elif what == "wrong head count":
        meta = dataclasses.replace(tiny.meta, num_heads=tiny.meta.num_heads * 2)
    elif what == "row not stored":
        keep = t["kv_buffer_slots"] != t["kv_indices"][0]
        t["kv_buffer_slots"] = t["kv_buffer_slots"][keep]
        t["layers.0.kv_buffer"] = t["layers.0.kv_buffer"][keep]
    elif what == "misspelt tensor":
        t["layers.0.lses"] = t.pop("layers.0.lse")
    else:
        raise AssertionError(what)
    return t, meta, version


BROKEN = {
    "wrong dtype": "layers.0.q: dtype F16, expected BF16",
    "non-monotone indptr": "kv_indptr: not monotone at request 1",
    "index out of range": "kv_indices: entry 3 is slot",
    "mask too short": "custom_mask: length",
    "out_cache_loc overlaps prefix": "out_cache_loc: entry 2",
    "NaN in q": "layers.0.q: non-finite value or one past +-1e+06 in token 4",
    "missing tensor": "layers.0.o: missing tensor",
    "unknown format version": "unknown format version 7",
    "non-topological tree": "request 2: draft block is not a well-formed tree: node 1 sees node 3",
    "not a tree": "not ancestor-closed",
    "slot 0 used": "slot 0 is SGLang's padding slot",
    "pool row differs from k": "differs from k[1]",
    "seq_lens disagree": "seq_lens: request 1",
    "wrong head count": "layers.0.q: shape",
    "row not stored": "whose row is not stored",
    "misspelt tensor": "layers.0.lses: unexpected tensor",
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_bad_capture_is_refused_with_a_named_problem(tmp_path, tiny, what):
    t, meta, version = _break(tiny, what)
    p = write_raw(tmp_path / "bad.safetensors", t, meta, version)
    before = sha(p)
    with pytest.raises(CaptureError) as e:
        load(p)
    msg = str(e.value)
    assert str(p) in msg
    assert BROKEN[what] in msg, msg
    assert sha(p) == before  # the loader never writes


def test_truncated_file_is_refused(tmp_path, tiny):
    p = save(tiny, tmp_path / "t.safetensors")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    before = sha(p)
    with pytest.raises(CaptureError, match="not a readable safetensors file"):
        load(p)
    assert sha(p) == before


def test_not_a_capture_is_refused(tmp_path):
    p = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(p))
    with pytest.raises(CaptureError, match="not a kdtree capture"):
        load(p)


def test_uint8_mask_as_under_cuda_graphs_is_accepted(tmp_path, tiny):
    t = tiny.tensor_dict()
    t["custom_mask"] = t["custom_mask"].to(torch.uint8)
    back = load(write_raw(tmp_path / "u8.safetensors", t, tiny.meta))
    assert torch.equal(back.tree_block(2), tiny.tree_block(2))


def test_a_saved_file_has_the_mode_open_gives_or_0600_when_private(tmp_path):
    """save_file (safetensors) leaves its files 0600; a shared capture gets the umask's mode, a server's own
    capture (private: activations derived from users' prompts) stays 0600."""
    import os
    import stat

    from kdtree.capture import save

    cap = small()
    umask = os.umask(0o022)
    try:
        public = save(cap, tmp_path / "a.safetensors")
        private = save(cap, tmp_path / "b.safetensors", private=True)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
