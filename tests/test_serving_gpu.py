"""The serving path on a GPU: the marshal kernel gives `kdtree.marshal`'s bits from SGLang-shaped (oversized)
buffers - the Triton backend's CSR metadata and SGLang's own page table -, the step is right against the fp64
oracle, an eager step's plan replayed from its plan graph equals the plan computed op by op, and a CUDA graph
captured once replays with other prefix lengths bit-equal to the eager path on the same inputs."""

from __future__ import annotations

import pytest
import torch

from kdtree.capture import load
from kdtree.diff import compare
from kdtree.marshal import marshal
from kdtree.outputs import AttnOutput, poisoned
from kdtree.reference import oracle

from conftest import SHIPPED, small, table_of

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["default", "blocks64"])
def path(request):
    """The serving path with each KDTREE_BODY (on a GPU without blocks64 both are its default)."""
    from kdtree.serving import ServingPath

    return ServingPath(body=request.param)


def sglang_buffers(cap, pad: int = 64, device="cuda"):
    """The capture's metadata as SGLang's Triton backend holds it under CUDA graphs: int64 indices, a uint8
    mask and index buffers longer than the batch."""

    def padded(t, dtype, extra):
        return torch.cat([t.to(dtype), torch.zeros(extra, dtype=dtype)]).to(device)

    extra = 3 if pad else 0
    return dict(
        qo_indptr=padded(cap.qo_indptr, torch.int64, extra),
        kv_indptr=padded(cap.kv_indptr, torch.int32, extra),
        kv_indices=padded(cap.kv_indices, torch.int64, pad),
        out_cache_loc=cap.out_cache_loc.to(device, torch.int64),
        custom_mask=padded(cap.custom_mask, torch.uint8, pad),
        mask_indptr=padded(cap.mask_indptr, torch.int64, extra),
    )


def run_step(path, cap, layer_id, bufs, o=None):
    step = path.prepare(
        **bufs,
        batch_size=cap.batch_size,
        num_draft=int(cap.num_draft[0]),
        num_heads=cap.meta.num_heads,
        kv_capacity=int(cap.kv_indptr[-1]) + cap.num_tokens + 5,
    )
    o = o if o is not None else poisoned((cap.num_tokens, cap.meta.num_heads, 512), "cuda")
    path.launch(
        step,
        cap.layer(layer_id).q.cuda(),
        cap.pool(layer_id, "cuda"),
        o,
        sm_scale=cap.meta.sm_scale,
        logit_cap=cap.meta.logit_cap,
    )
    return step, o


def capture_once_replay_many(step, load_batch, caps, o):
    """Capture `step` (after a warm-up outside the graph) on caps[0]'s inputs, then three rounds over the others:
    load each batch into the same tensors, replay, and check the output against the eager step on the same
    inputs (bit-equal) and against the fp64 oracle (5e-3)."""
    from kdtree.serving import captured

    load_batch(caps[0])
    torch.cuda.synchronize()
    graph = captured(step)
    for _ in range(3):
        for cap in caps[1:] + caps[:1]:
            load_batch(cap)
            o.fill_(float("nan"))
            graph.replay()
            replayed = o.clone()
            o.fill_(float("nan"))
            step()
            assert torch.equal(replayed.view(torch.int16), o.view(torch.int16)), "replay differs from eager"
            d = compare(cap, 0, AttnOutput(replayed, None), oracle(cap, 0, device="cuda"), tolerance=5e-3)
            assert d.passed, d.line()


@pytest.mark.parametrize("p", [p for p in SHIPPED if len(set(load(p).num_draft.tolist())) == 1], ids=lambda p: p.stem)
def test_marshal_kernel_and_device_plan_serve_every_capture(path, p):
    cap = load(p)
    want = marshal(cap)
    for lid in cap.meta.layer_ids:
        step, o = run_step(path, cap, lid, sglang_buffers(cap))
        total = int(want.combined_kv_indptr[-1])
        for name in ("qo_indptr", "combined_kv_indptr", "prefix_lens", "tree_mask"):
            assert torch.equal(getattr(step.args, name).cpu(), getattr(want, name)), name
        assert torch.equal(step.args.combined_kv_indices[:total].cpu(), want.combined_kv_indices)
        d = compare(cap, lid, AttnOutput(o, None), oracle(cap, lid, device="cuda"), tolerance=5e-3)
        assert d.passed, d.line()


def test_a_graph_captured_once_replays_new_lengths_bit_equal_to_eager(path):
    bs, budget, H = 4, 16, 8
    caps = [
        small(batch_size=bs, budget=budget, prefix_lens=p, seed=s)
        for s, p in enumerate([[1, 1, 1, 1], [0, 37, 900, 5], [2048, 1, 64, 300], [10, 1500, 0, 2], [700, 700, 33, 4000]])
    ]
    rows = max(c.meta.pool_size + 1 for c in caps)
    cap_kv = max(int(c.kv_indptr[-1]) for c in caps) + bs * (budget + 1)
    cap_mask = max(c.custom_mask.numel() for c in caps)
    static = dict(
        qo_indptr=torch.zeros(bs + 1, dtype=torch.int64, device="cuda"),
        kv_indptr=torch.zeros(bs + 1, dtype=torch.int32, device="cuda"),
        kv_indices=torch.zeros(cap_kv, dtype=torch.int64, device="cuda"),
        out_cache_loc=torch.zeros(bs * (budget + 1), dtype=torch.int64, device="cuda"),
        custom_mask=torch.zeros(cap_mask, dtype=torch.uint8, device="cuda"),
        mask_indptr=torch.zeros(bs + 1, dtype=torch.int64, device="cuda"),
    )
    q = torch.zeros(bs * (budget + 1), H, 576, dtype=torch.bfloat16, device="cuda")
    pool = torch.zeros(rows, 1, 576, dtype=torch.bfloat16, device="cuda")
    o = torch.zeros(bs * (budget + 1), H, 512, dtype=torch.bfloat16, device="cuda")

    def load_batch(cap):
        for name, t in sglang_buffers(cap, pad=0).items():
            static[name].zero_()
            static[name][: t.numel()].copy_(t)
        q.copy_(cap.layer(0).q)
        pool.zero_()
        pool[: cap.meta.pool_size + 1].copy_(cap.pool(0, "cuda").nan_to_num(0.0))

    def step():
        s = path.prepare(**static, batch_size=bs, num_draft=budget + 1, num_heads=H, kv_capacity=cap_kv)
        path.launch(s, q, pool, o, sm_scale=caps[0].meta.sm_scale)

    capture_once_replay_many(step, load_batch, caps, o)


def table_buffers(cap, *, seed: int = 0, table_dtype=torch.int32, pad: int = 64):
    """The capture as SGLang's ForwardBatch holds it (`conftest.table_of`), on the GPU, index buffers oversized."""
    t = table_of(cap, seed=seed, mask_dtype=torch.uint8, table_dtype=table_dtype)
    grow = lambda x, extra: torch.cat([x, torch.zeros(extra, dtype=x.dtype)]).cuda()  # noqa: E731
    return dict(
        req_to_token=t.req_to_token.cuda(),
        req_pool_indices=grow(t.req_pool_indices, 3),
        seq_lens=grow(t.seq_lens, 3),
        out_cache_loc=grow(t.out_cache_loc, pad),
        custom_mask=grow(t.custom_mask, pad),
    )


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("p", [p for p in SHIPPED if len(set(load(p).num_draft.tolist())) == 1], ids=lambda p: p.stem)
def test_marshal_from_the_page_table_serves_every_capture(path, p, table_dtype):
    cap = load(p)
    want = marshal(cap)
    total = int(want.combined_kv_indptr[-1])
    for lid in cap.meta.layer_ids:
        step = path.prepare_table(
            **table_buffers(cap, seed=lid, table_dtype=table_dtype),
            batch_size=cap.batch_size,
            num_draft=int(cap.num_draft[0]),
            num_heads=cap.meta.num_heads,
            kv_capacity=total + 7,
        )
        for name in ("qo_indptr", "combined_kv_indptr", "prefix_lens", "tree_mask"):
            assert torch.equal(getattr(step.args, name).cpu(), getattr(want, name)), name
        assert torch.equal(step.args.combined_kv_indices[:total].cpu(), want.combined_kv_indices)
        o = poisoned((cap.num_tokens, cap.meta.num_heads, 512), "cuda")
        path.launch(
            step, cap.layer(lid).q.cuda(), cap.pool(lid, "cuda"), o, sm_scale=cap.meta.sm_scale, logit_cap=cap.meta.logit_cap
        )
        d = compare(cap, lid, AttnOutput(o, None), oracle(cap, lid, device="cuda"), tolerance=5e-3)
        assert d.passed, d.line()


def test_the_plan_graph_replays_the_plan_op_by_op(path):
    """An eager step's plan comes from its shape's captured plan graph; with new lengths every time it equals
    `plan_on_device` run op by op on the same marshaled lengths."""
    from kdtree.device_plan import PlanShape, plan_on_device

    bs, budget, H = 3, 16, 16
    before = len(path.plan_graphs)
    assert path.use_plan_graphs
    for seed, prefixes in enumerate([[1, 1, 1], [0, 4000, 17], [900, 33, 2048], [5, 5, 70000]]):
        cap = small(batch_size=bs, budget=budget, prefix_lens=prefixes, seed=seed)
        step = path.prepare_table(
            **table_buffers(cap),
            batch_size=bs,
            num_draft=budget + 1,
            num_heads=H,
            kv_capacity=int(cap.kv_indptr[-1]) + cap.num_tokens,
        )
        key = (bs, budget + 1, H, 1, step.args.qo_indptr.device)
        assert key in path.plan_graphs and step.plan is path.plan_graphs[key].plan, "the plan came from its graph"
        shape, a = PlanShape(bs, budget + 1, H, path.config, path.grid), step.args
        direct = plan_on_device(*(t.clone() for t in (a.qo_indptr, a.combined_kv_indptr, a.prefix_lens, a.tree_mask)), shape)
        for name, arr in direct.arrays.items():
            assert torch.equal(step.plan.arrays[name], arr), (prefixes, name)
    assert len(path.plan_graphs) <= before + 1, "one plan graph for the one shape"
    assert path.plan_graph_error is None


@pytest.mark.parametrize("budget", [16, 160], ids=["N17", "N161"])
def test_the_page_table_path_replays_new_lengths_bit_equal_to_eager(path, budget):
    """A graph captured once over SGLang's page table (the backend's own metadata) replays batches of other
    prefix lengths (rows of prefix 1 among them: the length SGLang's graph runner pads with), bit-equal to the
    eager step and within 5e-3 of fp64 - with a short draft, and with one over 4 key tiles, whose plan ends row
    tiles at their last visible key (the mask reduction recorded in the graph)."""
    bs, H = 4, 8
    n = budget + 1
    caps = [
        small(batch_size=bs, budget=budget, prefix_lens=p, seed=s)
        for s, p in enumerate([[1, 1, 1, 1], [0, 37, 900, 5], [2048, 1, 64, 300], [700, 700, 33, 1]])
    ]
    rows = max(c.meta.pool_size + 1 for c in caps)
    width = 4096
    cap_kv = bs * width + bs * n
    static = dict(
        req_to_token=torch.zeros(bs + 3, width, dtype=torch.int32, device="cuda"),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device="cuda"),
        seq_lens=torch.ones(bs, dtype=torch.int64, device="cuda"),
        out_cache_loc=torch.zeros(bs * n, dtype=torch.int64, device="cuda"),
        custom_mask=torch.zeros(bs * n * (width + n), dtype=torch.uint8, device="cuda"),
    )
    q = torch.zeros(bs * n, H, 576, dtype=torch.bfloat16, device="cuda")
    pool = torch.zeros(rows, 1, 576, dtype=torch.bfloat16, device="cuda")
    o = torch.zeros(bs * n, H, 512, dtype=torch.bfloat16, device="cuda")

    def load_batch(cap):
        t = table_buffers(cap, pad=0)
        static["req_to_token"][:, : t["req_to_token"].shape[1]].copy_(t["req_to_token"])
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            static[name].copy_(t[name][: static[name].numel()])
        static["custom_mask"][: t["custom_mask"].numel()].copy_(t["custom_mask"])
        q.copy_(cap.layer(0).q)
        pool.zero_()
        pool[: cap.meta.pool_size + 1].copy_(cap.pool(0, "cuda").nan_to_num(0.0))

    def step():
        s = path.prepare_table(**static, batch_size=bs, num_draft=n, num_heads=H, kv_capacity=cap_kv)
        path.launch(s, q, pool, o, sm_scale=caps[0].meta.sm_scale)

    capture_once_replay_many(step, load_batch, caps, o)


def test_padded_rows_from_the_page_table_stay_inside_an_exact_mask(path):
    """Scratch rows as SGLang's graph runner pads (prefix 1, request row 0, out_cache_loc 0) after the real
    rows, with a mask exactly as long as the real rows need: the real rows' arguments are `kdtree.marshal`'s,
    the padded rows' mask reads stay inside the mask (no fault), and the real rows match the oracle."""
    cap = load(next(p for p in SHIPPED if p.stem == "server-ngram16"))
    real, pad, n = cap.batch_size, 3, int(cap.num_draft[0])
    t = table_buffers(cap, pad=0)
    bufs = dict(
        req_to_token=t["req_to_token"],
        req_pool_indices=torch.cat([t["req_pool_indices"][:real], torch.zeros(pad, dtype=torch.int64, device="cuda")]),
        seq_lens=torch.cat([t["seq_lens"][:real], torch.ones(pad, dtype=torch.int64, device="cuda")]),
        out_cache_loc=torch.cat([t["out_cache_loc"], torch.zeros(pad * n, dtype=torch.int64, device="cuda")]),
        custom_mask=t["custom_mask"][: int(cap.mask_indptr[-1])].clone(),
    )
    want = marshal(cap)
    total, T = int(want.combined_kv_indptr[-1]), cap.num_tokens
    step = path.prepare_table(
        **bufs, batch_size=real + pad, num_draft=n, num_heads=cap.meta.num_heads, kv_capacity=total + pad * (n + 1)
    )
    torch.cuda.synchronize()
    assert torch.equal(step.args.combined_kv_indptr[: real + 1].cpu(), want.combined_kv_indptr)
    assert torch.equal(step.args.combined_kv_indices[:total].cpu(), want.combined_kv_indices)
    assert torch.equal(step.args.tree_mask[:T].cpu(), want.tree_mask)
    o = poisoned(((real + pad) * n, cap.meta.num_heads, 512), "cuda")
    q = torch.cat([cap.layer(0).q.cuda(), torch.zeros(pad * n, cap.meta.num_heads, 576, dtype=torch.bfloat16, device="cuda")])
    path.launch(step, q, cap.pool(0, "cuda"), o, sm_scale=cap.meta.sm_scale, logit_cap=cap.meta.logit_cap)
    d = compare(cap, 0, AttnOutput(o[:T], None), oracle(cap, 0, device="cuda"), tolerance=5e-3)
    assert d.passed, d.line()
