from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kdtree.capture import FORMAT_VERSION, CaptureMeta, header_json
from kdtree.synth import SynthSpec, synthesize

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "data" / "captured_batches").glob("*.safetensors"))
# how far above the tolerance each historical bug takes the diff on a shipped capture: 10x, but 2x on the live
# server's chain (random weights: attention is flat over its 246-token prefix, so its 16 drafts weigh little and
# either bug moves the output by 2.3-2.9x the tolerance)
FAULT_MARGIN = {"server-chain16": 2.0}


def small(**kw):
    """A small synthetic capture (fast on CPU)."""
    base = dict(batch_size=3, prefix_lens=[0, 5, 40], budget=8, seed=11)
    base.update(kw)
    return synthesize(SynthSpec(**base))


def table_of(cap, *, width_pad: int = 5, seed: int = 0, mask_dtype=None, table_dtype=torch.int32):
    """A capture's metadata as SGLang's `ForwardBatch` holds it: each request's prefix slots in a row of a
    `req_to_token` table (rows shuffled, wider than any prefix, unused cells garbage), `seq_lens` the prefix
    lengths, `custom_mask` flat with N rows of prefix + N a request."""
    g = torch.Generator().manual_seed(seed)
    bs = cap.batch_size
    prefix = (cap.kv_indptr[1:] - cap.kv_indptr[:-1]).long()
    width = int(prefix.max()) + width_pad
    rows = torch.randperm(bs + 3, generator=g)[:bs]
    table = torch.randint(0, 1 << 20, (bs + 3, width), generator=g).to(table_dtype)
    for b in range(bs):
        p0 = int(cap.kv_indptr[b])
        table[rows[b], : int(prefix[b])] = cap.kv_indices[p0 : p0 + int(prefix[b])].to(table_dtype)
    from kdtree.sglang.verify import TableBatch

    return TableBatch(
        step=0,
        req_to_token=table,
        req_pool_indices=rows.long(),
        seq_lens=prefix,
        out_cache_loc=cap.out_cache_loc.long(),
        custom_mask=cap.custom_mask.to(mask_dtype or cap.custom_mask.dtype),
        batch_size=bs,
        num_draft=int(cap.num_draft.max()),
        kv_capacity=int(cap.kv_indptr[-1]) + cap.num_tokens,
    )


def visible_key_tiles(qo_indptr, prefix_lens, kv_lens, tree_mask, num_heads: int, bm: int, bn: int, rt_request, rt_row0):
    """Key tiles each row tile must visit, from the tree bits unpacked one by one (not the planner's word
    arithmetic): up to the last key any of its rows may see, at least one, never past the request's keys."""
    import numpy as np

    qo, prefix, kv = (np.asarray(x, dtype=np.int64) for x in (qo_indptr, prefix_lens, kv_lens))
    bits = np.unpackbits(np.ascontiguousarray(np.asarray(tree_mask, dtype=np.int32)).view(np.uint8), axis=1, bitorder="little")
    out = []
    for b, row0 in zip(np.asarray(rt_request), np.asarray(rt_row0)):
        rows = min(bm, (qo[b + 1] - qo[b]) * num_heads - row0)
        tokens = qo[b] + np.arange(row0, row0 + rows) // num_heads
        seen = np.flatnonzero(bits[tokens].any(0))
        keys = min(prefix[b] + (seen[-1] if len(seen) else -1) + 1, kv[b])
        out.append(max(1, -(-keys // bn)))
    return np.array(out, dtype=np.int64)


def write_raw(path: Path, tensors: dict[str, torch.Tensor], meta: CaptureMeta, version: int = FORMAT_VERSION) -> Path:
    """Write a capture file without any validation (to build broken ones)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"kdtree": header_json(meta, version)})
    return path


NOT_A_CACHE_FILE = ("fifo", "directory", "huge", "not utf-8")


def not_a_cache_file(path: Path, kind: str) -> Path:
    """Put at `path` what kdtree never wrote there: a FIFO (a blocking read would hang), a folder, 2 MB, bytes that
    are not UTF-8; "missing" leaves nothing."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        path.write_text(" " * (2 << 20))
    elif kind == "not utf-8":
        path.write_bytes(b"\xff\xfe{")
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tiny():
    return small()


def pytest_configure(config):
    """KDTREE_TEST_NVRTC=path/libnvrtc.so.N: every NVRTC test compiles with that library (say the NVRTC torch's CUDA
    build pins, beside the newest that the nvrtc extra installs)."""
    if path := os.environ.get("KDTREE_TEST_NVRTC"):
        from kdtree.kernel.nvrtc import use_nvrtc_library

        use_nvrtc_library(Path(path))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (run `make test-gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """The skipped tests, counted by why, after pytest's own summary and before its closing line: a class of tests
    that did not run (no GPU, no browser, no NVRTC) is said, not left among hundreds of short lines."""
    yield
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("kdtree: what did not run here")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.line(f"{n:5d} skipped: {reason}")
