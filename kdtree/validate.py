"""The rules a capture must keep. Each broken rule raises CaptureError naming file, tensor and rule.

Checked in order: tensors present and no strangers; dtypes and shapes (from the header, no data read);
indptrs (start at 0, monotone, consistent with each other and with the tensors they index); indices in
range, present in the stored pool rows, out_cache_loc disjoint from the prefixes and from slot 0;
the mask's length and each request's draft block a well-formed tree; positions; finite q/k; the
draft keys in the pool equal `k` (SGLang writes them before attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kdtree.format import (
    LAYER_TENSORS,
    OPTIONAL_LAYER_TENSORS,
    OPTIONAL_SHARED_TENSORS,
    POOL_SLOTS,
    SHARED_TENSORS,
    CaptureError,
    layer_key,
)

if TYPE_CHECKING:
    from kdtree.capture import Capture

INT_DTYPES = ("I32", "I64")
TENSOR_DTYPES = {
    "qo_indptr": INT_DTYPES,
    "kv_indptr": INT_DTYPES,
    "kv_indices": INT_DTYPES,
    "out_cache_loc": INT_DTYPES,
    "mask_indptr": INT_DTYPES,
    "seq_lens": INT_DTYPES,
    "positions": INT_DTYPES,
    POOL_SLOTS: INT_DTYPES,
    "custom_mask": ("BOOL", "U8"),
    "q": ("BF16",),
    "k": ("BF16",),
    "v": ("BF16",),
    "o": ("BF16",),
    "kv_buffer": ("BF16",),
    "lse": ("F32",),
}


def validate_capture(cap: Capture) -> None:
    _Checker(cap).run()


class _Checker:
    def __init__(self, cap: Capture):
        self.cap = cap
        self.m = cap.meta

    def fail(self, tensor: str | None, msg: str) -> CaptureError:
        return CaptureError(self.cap.where, tensor, msg)

    def run(self) -> None:
        self.m.check(self.cap.where)  # again for a capture built in memory (synth, a server's capture)
        self.check_names()
        self.check_headers()
        self.check_indptrs()
        self.check_slots()
        self.check_mask()
        self.check_positions()
        self.check_values()

    # -- presence ---------------------------------------------------------------------------------
    def check_names(self) -> None:
        names = self.cap._tensors.names
        expected = set(SHARED_TENSORS) | {POOL_SLOTS}
        for name in sorted(expected):
            if name not in names:
                raise self.fail(name, "missing tensor")
        for lid in self.m.layer_ids:
            for name in LAYER_TENSORS:
                if layer_key(lid, name) not in names:
                    raise self.fail(layer_key(lid, name), f"missing tensor (layer {lid} is in layer_ids)")
            expected |= {layer_key(lid, n) for n in LAYER_TENSORS + OPTIONAL_LAYER_TENSORS}
        expected |= set(OPTIONAL_SHARED_TENSORS)
        strangers = sorted(names - expected)
        if strangers:
            raise self.fail(strangers[0], f"unexpected tensor (layer not in layer_ids {self.m.layer_ids}, or a misspelt name)")

    # -- dtypes and shapes ------------------------------------------------------------------------
    def header(self, name: str, base: str | None = None) -> tuple[int, ...] | None:
        if name not in self.cap._tensors:
            return None
        dtype, shape = self.cap._tensors.header(name)
        allowed = TENSOR_DTYPES[base or name]
        if dtype not in allowed:
            raise self.fail(name, f"dtype {dtype}, expected {' or '.join(allowed)}")
        return shape

    def expect_shape(self, name: str, shape, expected: tuple, what: str) -> None:
        if shape is not None and tuple(shape) != tuple(expected):
            raise self.fail(name, f"shape {list(shape)}, expected {list(expected)} ({what})")

    def check_headers(self) -> None:
        m, H, D, Dv = self.m, self.m.num_heads, self.m.head_dim, self.m.v_head_dim
        qo = self.header("qo_indptr")
        if len(qo) != 1 or qo[0] < 2:
            raise self.fail("qo_indptr", f"shape {list(qo)}, expected [bs+1] with bs >= 1")
        bs = qo[0] - 1
        self.bs = bs
        for name in ("kv_indptr", "mask_indptr"):
            self.expect_shape(name, self.header(name), (bs + 1,), "bs+1 from qo_indptr")
        self.expect_shape("seq_lens", self.header("seq_lens"), (bs,), "bs from qo_indptr")
        for name in ("kv_indices", "out_cache_loc", "custom_mask", "positions", POOL_SLOTS):
            shape = self.header(name)
            if shape is not None and len(shape) != 1:
                raise self.fail(name, f"shape {list(shape)}, expected a 1-D tensor")
        rows = self.header(POOL_SLOTS)[0]
        self.T = int(self.cap.qo_indptr[-1])
        T = self.T
        self.expect_shape("out_cache_loc", self.header("out_cache_loc"), (T,), "T = qo_indptr[bs]")
        self.expect_shape("positions", self.header("positions"), (T,), "T = qo_indptr[bs]")
        for lid in m.layer_ids:
            shapes = {
                "q": (T, H, D),
                "k": (T, 1, D),
                "v": (T, 1, Dv),
                "o": (T, H, Dv),
                "lse": (T, H),
                "kv_buffer": (rows, 1, D),
            }
            for name, expected in shapes.items():
                key = layer_key(lid, name)
                self.expect_shape(key, self.header(key, base=name), expected, f"T={T}, H={H}, rows={rows}")

    # -- indptrs ----------------------------------------------------------------------------------
    def indptr(self, name: str, end: int | None, end_what: str, strict: bool = False) -> torch.Tensor:
        t = getattr(self.cap, name).long()
        if int(t[0]) != 0:
            raise self.fail(name, f"must start at 0, starts at {int(t[0])}")
        d = t[1:] - t[:-1]
        bad = (d <= 0) if strict else (d < 0)
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            kind = "strictly increasing (every request has >= 1 draft token)" if strict else "monotone"
            raise self.fail(name, f"not {kind} at request {b}: {int(t[b])} -> {int(t[b + 1])}")
        if end is not None and int(t[-1]) != end:
            raise self.fail(name, f"ends at {int(t[-1])} but {end_what} is {end}")
        return t

    def check_indptrs(self) -> None:
        cap = self.cap
        self.indptr("qo_indptr", None, "", strict=True)
        kv = self.indptr("kv_indptr", cap.kv_indices.numel(), "len(kv_indices)")
        prefix = kv[1:] - kv[:-1]
        n = cap.num_draft
        seq = cap.seq_lens.long()
        if not torch.equal(seq, prefix):
            b = int((seq != prefix).nonzero()[0])
            raise self.fail("seq_lens", f"request {b}: seq_lens={int(seq[b])} but kv_indptr gives prefix length {int(prefix[b])}")
        mi = self.indptr("mask_indptr", None, "")
        want = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(n * (prefix + n), 0)])
        if not torch.equal(mi, want):
            b = int((mi != want).nonzero()[0])
            raise self.fail("mask_indptr", f"entry {b} is {int(mi[b])}, expected {int(want[b])} = cumsum of N*(prefix_len+N)")
        length = cap.custom_mask.numel()
        if length != int(want[-1]):
            raise self.fail(
                "custom_mask",
                f"length {length}, expected sum of N*(prefix_len+N) = {int(want[-1])} "
                "(under CUDA graphs SGLang's buffer is oversized: slice it to mask_indptr[bs])",
            )

    # -- slots ------------------------------------------------------------------------------------
    def check_slots(self) -> None:
        cap, m = self.cap, self.m
        limit = m.pool_size + m.page_size
        slots = cap.kv_buffer_slots.long()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= limit):
            raise self.fail(POOL_SLOTS, f"slot outside [0, pool_size + page_size = {limit})")
        if slots.numel() > 1 and bool((slots[1:] <= slots[:-1]).any()):
            raise self.fail(POOL_SLOTS, "must be sorted and unique")
        for name in ("kv_indices", "out_cache_loc"):
            idx = getattr(cap, name).long()
            if idx.numel() == 0:
                continue
            bad = (idx < 1) | (idx >= limit)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise self.fail(
                    name,
                    f"entry {i} is slot {int(idx[i])}: outside [1, {limit}) (slot 0 is SGLang's padding slot; "
                    f"pool_size={m.pool_size}, page_size={m.page_size})",
                )
            pos = torch.searchsorted(slots, idx).clamp(max=max(slots.numel() - 1, 0))
            missing = slots.numel() == 0 or bool((slots[pos] != idx).any())
            if missing:
                i = 0 if slots.numel() == 0 else int((slots[pos] != idx).nonzero()[0])
                raise self.fail(name, f"entry {i} references slot {int(idx[i])} whose row is not stored in {POOL_SLOTS}")
        ocl = cap.out_cache_loc.long()
        if ocl.unique().numel() != ocl.numel():
            raise self.fail("out_cache_loc", "a slot appears twice: every draft token has its own slot")
        kv = cap.kv_indices.long()
        if kv.numel() > 1:  # (request, slot) pairs sorted: a pair twice is a prefix slot twice in one request
            req = torch.repeat_interleave(torch.arange(self.bs), cap.prefix_lens)
            pairs = (req * limit + kv).sort().values
            dup = pairs[1:] == pairs[:-1]
            if bool(dup.any()):
                raise self.fail("kv_indices", f"request {int(pairs[1:][dup][0]) // limit}: a prefix slot appears twice")
        overlap = torch.isin(ocl, cap.kv_indices.long())
        if bool(overlap.any()):
            i = int(overlap.nonzero()[0])
            raise self.fail("out_cache_loc", f"entry {i} (slot {int(ocl[i])}) is also a prefix slot in kv_indices")

    # -- mask -------------------------------------------------------------------------------------
    def check_mask(self) -> None:
        cap = self.cap
        mask = cap.custom_mask
        if mask.dtype == torch.uint8 and bool((mask > 1).any()):
            raise self.fail("custom_mask", "uint8 mask holds values other than 0 and 1")
        broken = (first_broken_tree(blocks, requests) for requests, blocks in self.tree_blocks())
        bad = [b for b in broken if b is not None]
        if bad:
            b = min(bad)
            raise self.fail(
                "custom_mask", f"request {b}: draft block is not a well-formed tree: {tree_block_problem(cap.tree_block(b))}"
            )

    def tree_blocks(self):
        """(request ids, their [B, N, N] draft blocks) for each N in the batch, gathered at once: the work is
        the mask's size, however many requests there are (no loop over requests)."""
        cap = self.cap
        n, prefix, start = cap.num_draft, cap.prefix_lens, cap.mask_indptr.long()[:-1]
        mask = cap.custom_mask.bool()
        for N in n.unique().tolist():
            b = (n == N).nonzero().flatten()
            i = torch.arange(N)
            at = start[b, None, None] + i[None, :, None] * (prefix[b, None, None] + N) + prefix[b, None, None] + i[None, None, :]
            yield b, mask[at]

    def check_positions(self) -> None:
        cap = self.cap
        if cap.positions is None:
            return
        pos = cap.positions.long()
        qo = cap.qo_indptr.long()
        worst = None
        for b, blocks in self.tree_blocks():
            N = blocks.shape[1]
            want = cap.prefix_lens[b, None] + blocks.sum(2) - 1  # depth: the ancestors a node sees, itself aside
            got = pos[qo[b, None] + torch.arange(N)[None, :]]
            wrong = (got != want).any(1)
            if bool(wrong.any()):
                k = int(wrong.nonzero()[0])
                i = int((got[k] != want[k]).nonzero()[0])
                found = (int(b[k]), i, int(got[k, i]), int(want[k, i]))
                worst = found if worst is None or found < worst else worst
        if worst is not None:
            b, i, got, want = worst
            raise self.fail("positions", f"request {b} node {i}: {got}, expected prefix_len + depth = {want}")

    # -- values -----------------------------------------------------------------------------------
    def check_values(self) -> None:
        cap = self.cap
        ocl = cap.out_cache_loc.long()
        slots = cap.kv_buffer_slots.long()
        rows_of_ocl = torch.searchsorted(slots, ocl)
        rows_read = torch.searchsorted(slots, torch.cat([cap.kv_indices.long(), ocl]).unique())
        for lid in self.m.layer_ids:
            layer = cap.layer(lid)
            for name in ("q", "k"):  # o and lse are checked when first read (Layer.o): loading stays lazy
                check_finite(cap, lid, name, getattr(layer, name))
            read = layer.kv_buffer_rows[rows_read]
            sane = (read.float().abs() <= MAX_ACTIVATION).reshape(read.shape[0], -1).all(1)  # False for NaN too
            if not bool(sane.all()):
                slot = int(slots[rows_read[~sane][0]])
                raise self.fail(
                    layer_key(lid, "kv_buffer"),
                    f"a non-finite value or one past +-{MAX_ACTIVATION:g} in the row of slot {slot}, which the step reads",
                )
            if layer_key(lid, "v") in cap._tensors and not torch.equal(layer.v, layer.k[..., : self.m.v_head_dim]):
                raise self.fail(layer_key(lid, "v"), "v must equal k[..., :512] (MLA: V is the latent part of K)")
            pooled = layer.kv_buffer_rows[rows_of_ocl]
            same = (pooled.view(torch.int16) == layer.k.view(torch.int16)).reshape(ocl.numel(), -1).all(1)
            if not bool(same.all()):
                i = int((~same).nonzero()[0])
                raise self.fail(
                    layer_key(lid, "kv_buffer"),
                    f"pool row at out_cache_loc[{i}] (slot {int(ocl[i])}) differs from k[{i}]: "
                    "SGLang writes k into the pool before attention; was the capture taken too early?",
                )


MAX_ACTIVATION = 1e6  # |q|, |k|, a pool row's entries: past this a 576-term fp32 dot product leaves no room


def check_finite(cap: Capture, layer_id: int, name: str, t: torch.Tensor) -> None:
    """CaptureError naming the first token of `t` (a layer's q, k, o or lse) that holds a NaN or an infinity, or (q
    and k) a value past +-MAX_ACTIVATION, which no attention in fp32 computes faithfully."""
    ok = torch.isfinite(t) if name in ("o", "lse") else t.float().abs() <= MAX_ACTIVATION
    if not bool(ok.all()):
        i = int((~ok).reshape(t.shape[0], -1).any(1).nonzero()[0])
        what = "non-finite value" if name in ("o", "lse") else f"non-finite value or one past +-{MAX_ACTIVATION:g}"
        raise CaptureError(cap.where, layer_key(layer_id, name), f"{what} in token {i}")


def first_broken_tree(blocks: torch.Tensor, requests: torch.Tensor) -> int | None:
    """The lowest request id among `requests` whose [N, N] block (of `blocks`, [B, N, N]) `tree_block_problem`
    refuses, or None: the same rules, for all B blocks at once."""
    B, n, _ = blocks.shape
    eye = torch.eye(n, dtype=torch.bool)
    bad = ~blocks.diagonal(dim1=1, dim2=2).all(1) | ~blocks[:, :, 0].all(1) | torch.triu(blocks, 1).flatten(1).any(1)
    if n > 1:
        off = blocks & ~eye
        parent = torch.where(off, torch.arange(n), -1).amax(2)  # [B, N]: each node's deepest visible earlier node
        expected = torch.gather(blocks, 1, parent[:, 1:, None].clamp(min=0).expand(B, n - 1, n)) | eye[1:]
        bad |= (expected != blocks[:, 1:]).flatten(1).any(1)
    return int(requests[bad].min()) if bool(bad.any()) else None


def tree_block_problem(block: torch.Tensor) -> str | None:
    """Why an [N, N] draft-visibility block is not a tree in topological order, or None.

    Rules: self visible, root visible, nothing later visible (topological), and every node sees exactly
    its parent's set plus itself, the parent being its deepest visible earlier node (ancestor-closed, a tree).
    """
    block = block.bool()
    n = block.shape[0]
    diag = block.diagonal()
    if not bool(diag.all()):
        return f"node {int((~diag).nonzero()[0])} does not see itself"
    if not bool(block[:, 0].all()):
        return f"node {int((~block[:, 0]).nonzero()[0])} does not see the root (node 0)"
    upper = torch.triu(block, diagonal=1)
    if bool(upper.any()):
        i, j = (int(x) for x in upper.nonzero()[0])
        return f"node {i} sees node {j} > {i}: nodes must be in topological order (parents before children)"
    if n == 1:
        return None
    off = block & ~torch.eye(n, dtype=torch.bool)
    cols = torch.arange(n)
    parent = torch.where(off, cols, torch.full_like(cols, -1)).amax(dim=1)
    rows = torch.arange(1, n)
    expected = block[parent[1:]].clone()
    expected[rows - 1, rows] = True
    wrong = (expected != block[1:]).any(1)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0]) + 1
        p = int(parent[i])
        extra = (block[i] & ~expected[i - 1]).nonzero().flatten().tolist()
        lost = (~block[i] & expected[i - 1]).nonzero().flatten().tolist()
        return f"node {i} is not ancestor-closed: its deepest visible node is {p}, but it " + (
            f"sees {extra[:4]} that {p} does not" if extra else f"misses {lost[:4]} that {p} sees"
        )
    return None
