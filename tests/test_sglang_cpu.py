"""The SGLang backend's SGLang-free parts on CPU: marshaling from SGLang's metadata tensors in torch ops, the
settings, the shadow line, bounded capture files, the plugin's entry point, and the backend's step state and
refusals on stand-ins for SGLang's modules. (The backend itself runs in SGLang's attention test kit on a GPU:
tests/test_sglang_gpu.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import sys
import types

import pytest
import torch

from kdtree.capture import load
from kdtree.marshal import marshal
from kdtree.selfcheck import ensure as _real_ensure
from kdtree.sglang.capture_hook import CaptureWriter, capture_tensors
from kdtree.sglang.settings import Settings, SettingsError
from kdtree.sglang.shadow import shadow_diff
from kdtree.sglang.verify import VerifyBatch

from conftest import SHIPPED, small, table_of

ARG_TENSORS = ("qo_indptr", "combined_kv_indptr", "combined_kv_indices", "prefix_lens", "tree_mask")


def batch_of(cap, *, pad: int = 0, mask_dtype=None, drop_mask: bool = False) -> VerifyBatch:
    """A capture's metadata as the backend takes it from SGLang, buffers optionally oversized as under graphs."""
    mask = cap.custom_mask.to(mask_dtype or cap.custom_mask.dtype)
    return VerifyBatch(
        step=0,
        qo_indptr=cap.qo_indptr,
        kv_indptr=cap.kv_indptr,
        kv_indices=torch.cat([cap.kv_indices, torch.full((pad,), 7, dtype=cap.kv_indices.dtype)]),
        out_cache_loc=cap.out_cache_loc,
        custom_mask=None if drop_mask else torch.cat([mask, torch.ones(pad, dtype=mask.dtype)]),
        mask_indptr=cap.mask_indptr,
        batch_size=cap.batch_size,
        num_draft=int(cap.num_draft.max()),
        kv_capacity=int(cap.kv_indptr[-1]) + cap.num_tokens,
    )


def assert_same_args(a, b):
    for name in ARG_TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_device_marshal_gives_the_same_bits_as_marshal(path):
    cap = load(path)
    want = marshal(cap)
    assert_same_args(batch_of(cap).marshal(cap.meta.sm_scale, 0.0), want)
    # SGLang's CUDA-graph buffers: oversized kv_indices and a uint8 mask longer than mask_indptr[bs]
    assert_same_args(batch_of(cap, pad=1000, mask_dtype=torch.uint8).marshal(cap.meta.sm_scale, 0.0), want)


@pytest.mark.parametrize(
    "seed,kind,n,prefixes",
    [
        (1, "ddtree", 33, [0, 1, 37, 200]),
        (2, "random", 65, [5]),
        (3, "star", 31, [0, 0]),
        (4, "eagle", 16, [64, 1, 300]),
        (5, "chain", 1, [3, 9]),
        (6, "chain", 32, [0, 129]),
    ],
)
def test_device_marshal_on_fresh_batches(seed, kind, n, prefixes):
    cap = small(seed=seed, tree=kind, num_draft_tokens=n, batch_size=len(prefixes), prefix_lens=prefixes, budget=None)
    assert_same_args(batch_of(cap).marshal(1.0, 0.0), marshal(cap))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_marshal_from_the_page_table_gives_the_same_bits_as_marshal(path):
    """The kdtree backend's own metadata (SGLang's req_to_token rows and seq_lens, no Triton metadata): the
    torch twin of `verify_mla_marshal_table_*` gives `kdtree.marshal`'s bits, int32 and int64 tables."""
    cap = load(path)
    if len(set(cap.num_draft.tolist())) != 1:
        pytest.skip("SGLang's verify batches have one N")
    want = marshal(cap)
    assert_same_args(table_of(cap).marshal(cap.meta.sm_scale, 0.0), want)
    assert_same_args(table_of(cap, seed=1, mask_dtype=torch.uint8, table_dtype=torch.int64).marshal(cap.meta.sm_scale, 0.0), want)


@pytest.mark.parametrize(
    "seed,kind,n,prefixes", [(1, "ddtree", 33, [0, 1, 37, 200]), (4, "eagle", 16, [64, 1, 300]), (5, "chain", 1, [3, 9])]
)
def test_marshal_from_the_page_table_on_fresh_batches(seed, kind, n, prefixes):
    cap = small(seed=seed, tree=kind, num_draft_tokens=n, batch_size=len(prefixes), prefix_lens=prefixes, budget=None)
    assert_same_args(table_of(cap, seed=seed).marshal(1.0, 0.0), marshal(cap))


def test_a_wrong_table_row_is_caught():
    """The comparison can fail: a request reading another request's row gives other slots."""
    cap = small(seed=2, tree="ddtree", num_draft_tokens=9, batch_size=3, prefix_lens=[40, 41, 42], budget=None)
    t = table_of(cap)
    t.req_pool_indices = t.req_pool_indices.roll(1)
    assert not torch.equal(t.marshal(1.0, 0.0).combined_kv_indices, marshal(cap).combined_kv_indices)


def test_no_custom_mask_means_causal_drafts():
    cap = load(next(p for p in SHIPPED if p.stem == "server-chain16"))
    b = batch_of(cap, drop_mask=True)
    assert_same_args(b.marshal(cap.meta.sm_scale, 0.0), marshal(cap))


def test_faulty_metadata_is_not_what_marshal_builds():
    """The comparison above can fail: the historical row-stride bug gives other bits."""
    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    wrong = marshal(cap, fault="prefix-stride")
    assert not torch.equal(batch_of(cap).marshal(1.0, 0.0).tree_mask, wrong.tree_mask)


def test_settings_from_the_environment():
    s = Settings.from_env({})
    assert (s.mode, s.layers, s.every, s.capture_max_files, s.capture_max_bytes) == ("serve", None, 1, 16, 2**30)
    assert 0 in s.ranks and 1 not in s.ranks
    assert s.body == "default"
    s = Settings.from_env(
        {
            "KDTREE_MODE": "Shadow",
            "KDTREE_BODY": " Blocks64",
            "KDTREE_LAYERS": "0,30-32",
            "KDTREE_RANKS": "all",
            "KDTREE_EVERY": "10",
            "KDTREE_CAPTURE_MAX_BYTES": "64M",
        }
    )
    assert s.mode == "shadow" and [i for i in range(40) if i in s.layers] == [0, 30, 31, 32] and s.ranks is None
    assert s.capture_max_bytes == 64 * 2**20
    assert s.body == "blocks64"
    assert s.watches(20, 31, 5) and not s.watches(25, 31, 5) and not s.watches(20, 29, 5)
    for env, name in [
        ({"KDTREE_MODE": "fast"}, "KDTREE_MODE"),
        ({"KDTREE_LAYERS": "3-1"}, "KDTREE_LAYERS"),
        ({"KDTREE_EVERY": "0"}, "KDTREE_EVERY"),
        ({"KDTREE_CAPTURE_MAX_BYTES": "lots"}, "KDTREE_CAPTURE_MAX_BYTES"),
        ({"KDTREE_RANKS": "x"}, "KDTREE_RANKS"),
        ({"KDTREE_BODY": "fastest"}, "KDTREE_BODY"),
        ({"KDTREE_CAPTURE_MAX_BYTES": "inf"}, "KDTREE_CAPTURE_MAX_BYTES"),
        ({"KDTREE_CAPTURE_MAX_BYTES": "1e400"}, "KDTREE_CAPTURE_MAX_BYTES"),
        ({"KDTREE_CAPTURE_MAX_BYTES": "nanG"}, "KDTREE_CAPTURE_MAX_BYTES"),
        ({"KDTREE_TOLERANCE": "nan"}, "KDTREE_TOLERANCE"),
        ({"KDTREE_TOLERANCE": "inf"}, "KDTREE_TOLERANCE"),
        ({"KDTREE_EVERY": "9" * 40}, "KDTREE_EVERY"),
        ({"KDTREE_LAYERS": "0-99999999999"}, "KDTREE_LAYERS"),
        ({"KDTREE_LAYERS": "1,,2"}, "KDTREE_LAYERS"),
        ({"KDTREE_LAYERS": "1," * 5000}, "KDTREE_LAYERS"),
        ({"KDTREE_LAYERS": "0-"}, "KDTREE_LAYERS"),
        ({"KDTREE_EVERY": "\u0661"}, "KDTREE_EVERY"),
        ({"KDTREE_CAPTURE_MAX_FILES": "1_000"}, "KDTREE_CAPTURE_MAX_FILES"),
        ({"KDTREE_CAPTURE_DIR": "a\0b"}, "KDTREE_CAPTURE_DIR"),
        ({"KDTREE_CAPTURE_DIR": ""}, "KDTREE_CAPTURE_DIR"),
    ]:
        with pytest.raises(SettingsError, match=name):
            Settings.from_env(env)


def test_a_huge_id_range_is_kept_as_a_range():
    """KDTREE_LAYERS=0-300000000 once expanded into a set of 300 million ints until the OOM killer came: a range
    is kept as its two ends, checked in constant time."""
    import time
    import tracemalloc

    tracemalloc.start()
    t = time.perf_counter()
    s = Settings.from_env({"KDTREE_LAYERS": "0-300000000,2147483647", "KDTREE_RANKS": "0-7"})
    took, (_, peak) = time.perf_counter() - t, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert took < 0.1 and peak < 1 << 20
    assert 299_999_999 in s.layers and 300_000_001 not in s.layers and 2**31 - 1 in s.layers and 7 in s.ranks


def test_a_bad_setting_never_stops_the_server(standin_backend, monkeypatch, caplog):
    """A variable kdtree cannot use is said once at start-up, naming it, and Triton serves: the server starts."""
    from kdtree.sglang import log
    from kdtree.sglang.step import Refusal

    backend, _ = standin_backend
    monkeypatch.setenv("KDTREE_CAPTURE_MAX_BYTES", "inf")
    monkeypatch.setattr(log, "_said", set())
    with caplog.at_level(logging.INFO, logger="kdtree"):
        b = type(backend)(types.SimpleNamespace(tp_rank=0, tp_size=1, model_config=types.SimpleNamespace(model_path="tiny")))
    (line,) = [r.getMessage() for r in caplog.records if "KDTREE_CAPTURE_MAX_BYTES" in r.getMessage()]
    assert "Triton serves every step" in line and b.settings.mode == "triton"
    assert b.step_refusal(forward_batch()) == Refusal.MODE.format(mode="triton")


def test_shadow_line_names_the_worst_element():
    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    ref = cap.layer(0).o.float()
    exact = shadow_diff(ref.clone(), ref, cap.qo_indptr, layer=58, step=3)
    assert exact.rel == 0 and exact.line(5e-3).startswith("[kdtree] L58 max_abs_diff=0.0000e+00 mean=0.0000e+00 rel=")
    assert "worst" not in exact.line(5e-3)
    bad = ref.clone()
    t = int(cap.qo_indptr[2]) + 5  # request 2, node 5
    bad[t, 3] += 50.0
    d = shadow_diff(bad, ref, cap.qo_indptr, layer=58, step=3)
    assert d.worst == {"request": 2, "node": 5, "head": 3, "abs": pytest.approx(50.0, rel=1e-3)}
    assert "worst: request=2 node=5 head=3" in d.line(5e-3)
    bad[0, 0, 0] = float("nan")
    d = shadow_diff(bad, ref, cap.qo_indptr, layer=58, step=3)
    assert d.nonfinite == 1 and d.worst["request"] == 0 and "nonfinite=1" in d.line(5e-3)


def _one_layer(cap):
    """(batch, q, o, pool) of a shipped capture, as capture mode gets them in a server."""
    layer = cap.layer(cap.meta.layer_ids[0])
    return batch_of(cap), layer.q, layer.o, cap.pool(cap.meta.layer_ids[0]).nan_to_num(0.0)


def test_capture_files_round_trip_and_stop_at_the_file_budget(tmp_path, caplog):
    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    batch, q, o, pool = _one_layer(cap)
    tensors = capture_tensors(batch, 0, q, o, pool)
    w = CaptureWriter(tmp_path / "caps", max_files=2, max_bytes=2**30)
    with caplog.at_level(logging.WARNING, logger="kdtree"):
        paths = [w.write(f"s{i}.safetensors", cap.meta, tensors) for i in range(4)]
    assert paths[2] is None and paths[3] is None and not w.enabled
    assert sorted(p.name for p in (tmp_path / "caps").iterdir()) == [f"s0-{w.run}.safetensors", f"s1-{w.run}.safetensors"]
    back = load(paths[0])
    for name in ("kv_indices", "out_cache_loc", "custom_mask", "layers.0.q", "layers.0.o", "layers.0.k"):
        assert torch.equal(back.tensor_dict()[name], cap.tensor_dict()[name]), name
    assert len([r for r in caplog.records if "KDTREE_CAPTURE_MAX_FILES" in r.getMessage()]) == 1


def test_capture_stops_before_the_byte_budget_and_writes_nothing_partial(tmp_path):
    cap = load(next(p for p in SHIPPED if p.stem == "server-chain16"))
    tensors = capture_tensors(*_one_layer(cap)[:1], 0, *_one_layer(cap)[1:])
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    w = CaptureWriter(tmp_path, max_files=10, max_bytes=size * 3 // 2)  # room for one file, not two
    assert w.write("a.safetensors", cap.meta, tensors) is not None
    assert w.write("b.safetensors", cap.meta, tensors) is None and not w.enabled
    assert [p.name for p in tmp_path.iterdir()] == [f"a-{w.run}.safetensors"]


def test_an_unwritable_directory_or_an_invalid_step_stops_capture_quietly(tmp_path):
    cap = load(next(p for p in SHIPPED if p.stem == "server-chain16"))
    batch, q, o, pool = _one_layer(cap)
    tensors = capture_tensors(batch, 0, q, o, pool)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert CaptureWriter(blocker / "caps", 4, 2**30).write("a.safetensors", cap.meta, tensors) is None
    broken = dict(tensors, out_cache_loc=tensors["kv_indices"][: tensors["out_cache_loc"].numel()])  # drafts on prefix slots
    w = CaptureWriter(tmp_path / "caps", 4, 2**30)
    assert w.write("bad.safetensors", cap.meta, broken) is None and not w.enabled
    assert not (tmp_path / "caps").exists() or not any((tmp_path / "caps").iterdir())


def test_a_second_writer_replaces_nothing_and_counts_what_is_there(tmp_path, monkeypatch, caplog):
    """A restarted server (or a second replica) writing into the same folder: its files carry its own run tag, so
    none replaces the first's, and the first's files count toward its budgets."""
    from kdtree.sglang import log

    monkeypatch.setattr(log, "_said", set())
    cap = load(next(p for p in SHIPPED if p.stem == "server-chain16"))
    tensors = capture_tensors(*_one_layer(cap)[:1], 0, *_one_layer(cap)[1:])
    first = CaptureWriter(tmp_path, max_files=3, max_bytes=2**30, run="run-a")
    a = [first.write(f"step{i:06d}-L0-tp0", cap.meta, tensors) for i in range(2)]
    before = {p: p.read_bytes() for p in a}
    second = CaptureWriter(tmp_path, max_files=3, max_bytes=2**30, run="run-b")
    with caplog.at_level(logging.INFO, logger="kdtree"):
        b = [second.write(f"step{i:06d}-L0-tp0", cap.meta, tensors) for i in range(2)]
    assert b[0] is not None and b[0] not in a and b[1] is None and not second.enabled  # 2 there + 1 = the budget of 3
    assert all(p.read_bytes() == data for p, data in before.items())
    assert "2 files" in caplog.text and "already in" in caplog.text and "KDTREE_CAPTURE_MAX_FILES" in caplog.text
    assert CaptureWriter(tmp_path, 9, 2**30).run != CaptureWriter(tmp_path, 9, 2**30, run="x").run


def test_a_full_disk_stops_capture_once_whatever_the_error_type(tmp_path, monkeypatch, caplog):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: capture stops at the first
    failure, says so once, and leaves no temporary file; later layers are not tried."""
    import safetensors

    from kdtree import capture as capture_module
    from kdtree.sglang import log

    cap = load(next(p for p in SHIPPED if p.stem == "server-chain16"))
    tensors = capture_tensors(*_one_layer(cap)[:1], 0, *_one_layer(cap)[1:])
    calls = []

    def full(*args, **kwargs):
        calls.append(1)
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(capture_module, "save_file", full)
    monkeypatch.setattr(log, "_said", set())
    w = CaptureWriter(tmp_path, max_files=9, max_bytes=2**30)
    with caplog.at_level(logging.WARNING, logger="kdtree"):
        assert [w.write(f"s{i}", cap.meta, tensors) for i in range(5)] == [None] * 5
    assert len(calls) == 1 and not w.enabled and list(tmp_path.iterdir()) == []
    (line,) = [r.getMessage() for r in caplog.records if "capture stopped" in r.getMessage()]
    assert "StorageFull" in line and "serving goes on" in line


def test_the_plugin_entry_point_is_installed_and_loads_without_sglang():
    (ep,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "kdtree"]
    assert ep.value == "kdtree.sglang.plugin:register"
    had_sglang = "sglang" in sys.modules
    fn = ep.load()
    assert callable(fn) and fn.__name__ == "register"
    assert ("sglang" in sys.modules) == had_sglang, "loading the entry point imported SGLang"


def test_the_sglang_extra_pins_the_supported_range():
    reqs = importlib.metadata.requires("kdtree") or []
    (sglang,) = [r for r in reqs if r.startswith("sglang") and 'extra == "sglang"' in r]
    assert ">=0.5.23" in sglang and "<0.6" in sglang


class CountingPath:
    """Stands in for kdtree.serving.ServingPath, which needs a GPU (CuPy, the kernels): records prepares and
    launches, so the runner's once-per-step rule can be checked on CPU."""

    def __init__(self):
        self.prepared, self.launched = [], 0

    def prepare(self, *tensors, **sizes):
        self.prepared.append(sizes)
        return type("Step", (), {"args": None})()

    def launch(self, step, q, kv_buffer, o, **kw):
        self.launched += 1
        return o


def test_the_runner_prepares_once_per_step_object_and_again_for_a_capture(monkeypatch):
    from kdtree.sglang.verify import VerifyRunner

    monkeypatch.setattr("kdtree.kernel.check_inputs", lambda *a: None)
    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    path = CountingPath()
    runner = VerifyRunner(path)
    q, pool = cap.layer(0).q, cap.pool(0)
    o = torch.empty(cap.num_tokens, cap.meta.num_heads, 512)
    warmup = batch_of(cap)
    for _ in range(3):  # a step's layers (or a captured batch's eager warm-ups): one prepare
        runner.run(warmup, q, pool, o, sm_scale=1.0, logit_cap=0.0)
    captured = batch_of(cap)  # the backend builds a new batch when the capture starts: prepared again
    runner.run(captured, q, pool, o, sm_scale=1.0, logit_cap=0.0)
    runner.run(captured, q, pool, o, sm_scale=1.0, logit_cap=0.0)
    runner.new_step()
    runner.run(captured, q, pool, o, sm_scale=1.0, logit_cap=0.0)
    assert len(path.prepared) == 3 and path.launched == 6
    assert path.prepared[0]["num_heads"] == cap.meta.num_heads and path.prepared[0]["batch_size"] == cap.batch_size


def test_padded_rows_as_sglang_pads_them_leave_the_real_rows_alone():
    """SGLang pads a replayed batch to the graph's size with scratch rows (its kit's prod_fill: prefix length =
    the fill value 1, req_pool_indices 0, out_cache_loc 0; the mask buffer past the real rows is stale): the
    marshaling of the real rows is unchanged and the padded rows stay inside the buffers."""
    from kdtree.device_plan import PlanShape, plan_on_device
    from kdtree.kernel import KernelConfig

    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    real, pad, n = cap.batch_size, 3, int(cap.num_draft[0])
    bs = real + pad
    prefix = cap.prefix_lens.tolist() + [1] * pad
    kv_indptr = torch.tensor([0] + prefix).cumsum(0).to(torch.int32)
    kv_indices = torch.cat([cap.kv_indices, cap.kv_indices[:pad]])  # request 0's first slots (req_pool_indices 0)
    mask_indptr = torch.tensor([0] + [n * (p + n) for p in prefix]).cumsum(0)
    stale = torch.randint(0, 2, (int(mask_indptr[-1]) - cap.custom_mask.numel() + 100,), dtype=torch.uint8)
    batch = VerifyBatch(
        step=0,
        qo_indptr=torch.arange(bs + 1, dtype=torch.int32) * n,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        out_cache_loc=torch.cat([cap.out_cache_loc, torch.zeros(pad * n, dtype=cap.out_cache_loc.dtype)]),
        custom_mask=torch.cat([cap.custom_mask.to(torch.uint8), stale]),
        mask_indptr=mask_indptr,
        batch_size=bs,
        num_draft=n,
        kv_capacity=int(kv_indptr[-1]) + bs * n,
    )
    got, want = batch.marshal(cap.meta.sm_scale, 0.0), marshal(cap)
    T, total = cap.num_tokens, int(want.combined_kv_indptr[-1])
    assert torch.equal(got.combined_kv_indptr[: real + 1], want.combined_kv_indptr)
    assert torch.equal(got.combined_kv_indices[:total], want.combined_kv_indices)
    assert torch.equal(got.tree_mask[:T], want.tree_mask) and torch.equal(got.prefix_lens[:real], want.prefix_lens)
    pool_rows = cap.meta.pool_size + cap.meta.page_size
    assert int(got.combined_kv_indices.max()) < pool_rows and int(got.combined_kv_indices.min()) >= 0
    shape = PlanShape(bs, n, cap.meta.num_heads, KernelConfig.for_arch("sm_90"), 132)
    p = plan_on_device(got.qo_indptr, got.combined_kv_indptr, got.prefix_lens, got.tree_mask, shape)
    assert int(p.arrays["rt_unit_start"][-1]) == int(p.arrays["cta_unit_start"][-1])  # every unit, padded rows too


def test_padded_rows_from_the_page_table_leave_the_real_rows_alone():
    """The same padding through the backend's own metadata: scratch rows of prefix 1 on request row 0 and
    out_cache_loc 0, the mask exactly as long as the real rows need (SGLang's spec_info covers only them), so
    the padded rows' mask reads run past its end (the kernel and this twin clamp them to its last cell)."""
    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    real, pad, n = cap.batch_size, 3, int(cap.num_draft[0])
    t = table_of(cap)
    t.req_pool_indices = torch.cat([t.req_pool_indices, torch.zeros(pad, dtype=torch.long)])
    t.seq_lens = torch.cat([t.seq_lens, torch.ones(pad, dtype=torch.long)])
    t.out_cache_loc = torch.cat([t.out_cache_loc, torch.zeros(pad * n, dtype=torch.long)])
    t.batch_size, t.kv_capacity = real + pad, t.kv_capacity + pad * (n + 1)
    assert t.custom_mask.numel() == int(cap.mask_indptr[-1])  # exactly the real rows' cells
    got, want = t.marshal(cap.meta.sm_scale, 0.0), marshal(cap)
    T, total = cap.num_tokens, int(want.combined_kv_indptr[-1])
    assert torch.equal(got.combined_kv_indptr[: real + 1], want.combined_kv_indptr)
    assert torch.equal(got.combined_kv_indices[:total], want.combined_kv_indices)
    assert torch.equal(got.tree_mask[:T], want.tree_mask) and torch.equal(got.prefix_lens[:real], want.prefix_lens)
    assert torch.equal(got.prefix_lens[real:], torch.ones(pad, dtype=torch.int32))


def test_the_serving_body_is_a_candidate_of_the_target():
    """KDTREE_BODY picks among the target's own configurations: `blocks64` is Hopper's blocks64 one; a
    target without one keeps its default and says why (the server logs it once and goes on)."""
    from kdtree.kernel import KernelConfig
    from kdtree.serving import serving_config

    hopper = KernelConfig.candidates("sm_90")
    assert serving_config(hopper) == (hopper[0], None) and not hopper[0].blocks64
    config, why = serving_config(hopper, "blocks64")
    assert config.blocks64 and config.wgmma and why is None and config in hopper
    blackwell = KernelConfig.candidates("sm_120")
    config, why = serving_config(blackwell, "blocks64")
    assert config == blackwell[0] and "blocks64" in why
    with pytest.raises(ValueError, match="fastest"):
        serving_config(hopper, "fastest")


# ----- the backend's step state, on stand-ins for the three SGLang modules it imports -----------------------------
def test_every_refusal_reason_has_one_message_and_the_backend_spells_none_itself():
    """`Refusal` holds each reason's message once (enum.unique); backend.py returns no message of its own."""
    import ast
    from pathlib import Path

    import kdtree.sglang
    from kdtree.sglang.step import Refusal

    assert len({r.value for r in Refusal}) == len(Refusal)
    source = (Path(kdtree.sglang.__file__).parent / "backend.py").read_text()
    checks = [f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name.endswith("refusal")]
    assert {f.name for f in checks} == {"step_refusal", "kdtree_refusal", "_batch_refusal"}
    spelt = [  # words a refusal check returns that are not a Refusal's
        n.value
        for f in checks
        for node in ast.walk(f)
        if isinstance(node, ast.Return)
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and " " in n.value
    ]
    assert spelt == [], spelt


class _Triton:
    """SGLang's TritonAttnBackend as far as the kdtree backend's step hooks use it; counts metadata builds."""

    def __init__(self, model_runner, *args, **kwargs):
        self.metadata_builds = 0
        self.use_mla, self.dcp_size, self.enable_deterministic = True, 1, False
        self.req_to_token = torch.zeros(8, 64, dtype=torch.int32)
        self.max_context_len, self.num_draft_tokens, self.num_head = 64, 4, 8
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        self.metadata_builds += 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.metadata_builds += 1

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def init_cuda_graph_state(self, max_bs, max_num_tokens, *args, **kwargs):
        pass

    def on_after_cuda_graph_warmup(self):
        pass


@pytest.fixture
def standin_backend(monkeypatch):
    """The kdtree backend over `_Triton`, SGLang's modules stood in for, CUDA-graph capture a flag, its self-check
    (which needs a GPU) passed."""
    import types

    from kdtree import selfcheck

    mods = {
        "sglang.srt.layers.attention.triton_backend": {"TritonAttnBackend": _Triton},
        "sglang.srt.layers.radix_attention": {"AttentionType": types.SimpleNamespace(DECODER="decoder")},
        "sglang.srt.mem_cache.memory_pool": {"KVWriteLoc": object},
    }
    for name, attrs in mods.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    monkeypatch.delitem(sys.modules, "kdtree.sglang.backend", raising=False)
    monkeypatch.delenv("KDTREE_MODE", raising=False)
    monkeypatch.setattr(selfcheck, "ensure", lambda impl: selfcheck.Outcome(_verdict(True), True))
    capturing = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    from kdtree.sglang.backend import KdtreeAttnBackend

    runner = types.SimpleNamespace(tp_rank=0, tp_size=1, model_config=types.SimpleNamespace(model_path="tiny"))
    backend = KdtreeAttnBackend(runner)
    backend.runner.prepare = lambda batch, heads: None  # the marshal kernel needs a GPU
    yield backend, capturing
    monkeypatch.delitem(sys.modules, "kdtree.sglang.backend", raising=False)


def forward_batch(verify: bool = True, bs: int = 2, n: int = 4, tokens: int | None = None):
    import types

    return types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_target_verify=lambda: verify),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.full((bs,), 10),
        seq_lens_sum=10 * bs,
        out_cache_loc=torch.arange(bs * n if tokens is None else tokens),
        spec_info=types.SimpleNamespace(num_tokens_per_req=n, custom_mask=None),
    )


def _verdict(passed: bool):
    from kdtree import selfcheck

    key = selfcheck.Key("NVIDIA RTX PRO 6000 Blackwell", "sm_120", "CUDA driver 13.1", "0" * 16)
    row = selfcheck.Row("fuzz seed 17", 1, 1.5e-3 if passed else 0.9, passed, 0.1)
    return selfcheck.Verdict(key, passed, 1e-2, [row], 0.1, "2026-12-06T00:00:00Z")


@pytest.mark.parametrize("outcome", ["pass", "fail", "error", "skipped"])
def test_the_backend_serves_only_after_its_self_check_passes(standin_backend, monkeypatch, caplog, outcome):
    """Built in serve mode, the backend runs the self-check before any step: a FAIL, or a check that cannot run,
    makes the server's verify steps Triton's with one line saying why; a pass or a skip leaves kdtree serving."""
    from kdtree import selfcheck
    from kdtree.sglang import log
    from kdtree.sglang.step import Refusal

    backend, _ = standin_backend
    cls = type(backend)

    def ensure(impl):
        if outcome == "error":
            raise RuntimeError("no CUDA device")
        return selfcheck.Outcome(None if outcome == "skipped" else _verdict(outcome == "pass"))

    monkeypatch.setattr(selfcheck, "ensure", ensure)
    monkeypatch.setattr(log, "_said", set())
    with caplog.at_level(logging.INFO, logger="kdtree"):
        b = cls(types.SimpleNamespace(tp_rank=0, tp_size=1, model_config=types.SimpleNamespace(model_path="tiny")))
    lines = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert len(lines) == 1, lines
    want = {"pass": ("serve", "self-check passed"), "skipped": ("serve", "skipped (KDTREE_SELFCHECK=0)"),
            "fail": ("triton", "FAILED on NVIDIA RTX PRO 6000 Blackwell (fuzz seed 17: rel 9.00e-01"),
            "error": ("triton", "could not prepare: its self-check did not run (RuntimeError: no CUDA device)")}[outcome]  # fmt: skip
    assert b.settings.mode == want[0] and want[1] in lines[0]
    if want[0] == "triton":
        assert b.step_refusal(forward_batch()) == Refusal.MODE.format(mode="triton")


@pytest.mark.parametrize("fault", ["malformed", "fifo", "unwritable"])
def test_a_bad_verdict_cache_never_stops_the_server(standin_backend, monkeypatch, caplog, tmp_path, fault):
    """The real `selfcheck.ensure` under the backend (the check itself stood in for: it needs a GPU), with a cache
    kdtree did not write: a malformed verdict under this key (`passed: false, rows: []`, which once raised out of
    the backend's constructor), a FIFO at the verdict's path, a cache folder that cannot be written. The backend is
    built, checks again, serves, and says what it ignored in its one self-check line."""
    from kdtree import selfcheck
    from kdtree.sglang import log

    backend, _ = standin_backend
    monkeypatch.setattr(selfcheck, "ensure", _real_ensure)  # not the fixture's stand-in
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(selfcheck.SKIP_VAR, raising=False)
    monkeypatch.delenv("KDTREE_MODE", raising=False)
    key = _verdict(True).key
    monkeypatch.setattr(selfcheck, "current_key", lambda impl: key)
    monkeypatch.setattr(selfcheck, "run", lambda key, *a, **kw: _verdict(True))
    path = selfcheck.verdict_path(key)
    path.parent.mkdir(parents=True)
    if fault == "malformed":
        path.write_text(json.dumps({**_verdict(True).to_json(), "passed": False, "rows": []}))
    elif fault == "fifo":
        os.mkfifo(path)
    else:
        path.parent.rmdir()
        path.parent.write_text("a file where the cache folder should be")
    monkeypatch.setattr(log, "_said", set())
    with caplog.at_level(logging.INFO, logger="kdtree"):
        b = type(backend)(types.SimpleNamespace(tp_rank=0, tp_size=1, model_config=types.SimpleNamespace(model_path="tiny")))
    (line,) = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert b.settings.mode == "serve" and "self-check passed" in line, line
    said = f"cache not writable: {path.parent}: " if fault == "unwritable" else f"cached verdict ignored: {path}: "
    assert said in line, line


def test_the_backend_keeps_its_step_in_one_state(standin_backend):
    """A verify step kdtree owns builds no Triton metadata and counts a verify step; a refused step (not verify, a
    token count that is not batch x draft tokens) is Triton's with its metadata; a capture in which only kdtree
    ran lets its batch size replay without Triton's hook, and one in which Triton ran does not."""
    import dataclasses

    from kdtree.sglang.step import Refusal
    from kdtree.sglang.verify import TableBatch

    backend, capturing = standin_backend
    state = backend.step_state
    fb = forward_batch()
    assert backend.step_refusal(fb) is None and state.table[0] is backend.req_to_token
    backend.init_forward_metadata(fb)
    assert state.owned and not backend._triton_ready and backend.metadata_builds == 0 and backend.verify_step == 0
    batch = backend.verify_batch(fb)
    assert isinstance(batch, TableBatch) and batch.step == 0 and backend.verify_batch(fb) is batch
    backend.ensure_triton_metadata(fb)
    assert backend._triton_ready and backend.metadata_builds == 1

    assert backend.step_refusal(forward_batch(verify=False)) == Refusal.NOT_VERIFY
    assert backend.step_refusal(forward_batch(tokens=7)) == Refusal.TOKEN_COUNT
    backend.init_forward_metadata(forward_batch(verify=False))
    assert not state.owned and backend._triton_ready and state.batch is None and backend.verify_step == 0
    backend.settings = dataclasses.replace(backend.settings, mode="shadow")
    assert backend.step_refusal(fb) == "KDTREE_MODE=shadow" == Refusal.MODE.format(mode="shadow")
    backend.settings = dataclasses.replace(backend.settings, mode="serve")

    backend.init_cuda_graph_state(2, 8)
    assert state.graph_kv_capacity == 2 * 64 + 8
    for kdtree_only, bs in ((True, 2), (False, 3)):
        fb = forward_batch(bs=bs)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        assert state.graph_capture == (bs, [False, False]) and state.owned
        capturing["on"] = True
        backend._note_capture(kdtree=True)
        if not kdtree_only:
            backend._note_capture(kdtree=False)
        capturing["on"] = False
        backend.init_forward_metadata_out_graph(fb)  # a replay: closes the capture first
        assert state.graph_capture is None and (bs in backend._kdtree_graphs) == kdtree_only
        assert state.owned == kdtree_only and backend._triton_ready != kdtree_only
    assert backend.verify_step == 4  # two captures, two replays after the first step
