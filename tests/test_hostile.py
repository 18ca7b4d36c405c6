"""The fault drill (CPU): hostile files and a hostile machine against kdtree's promises - bad input is exit 2 with
one line naming the file and why, a bug alone is exit 3, nothing is lost or half-written. The server-side faults
(a bad verdict cache, a bad setting, a full capture disk) are in tests/test_sglang_cpu.py and test_selfcheck.py."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import torch
from typer.testing import CliRunner

from kdtree import files
from kdtree.cli import app

SYNTH = ["synth", "--budget", "8", "--batch", "1", "--prefix", "16", "--seed", "1"]


@pytest.mark.parametrize(
    "code,where",
    [(errno.ENOSPC, "fsync"), (errno.EFBIG, "fsync"), (errno.EROFS, "mkstemp"), (errno.EACCES, "mkstemp")],
)
def test_a_write_the_machine_refuses_is_exit_2_naming_the_file_and_the_old_file_stays(tmp_path, monkeypatch, code, where):
    """`kdtree synth --force` over an existing capture on a full disk (ENOSPC), past a file-size limit (EFBIG), into
    a read-only (EROFS) or forbidden (EACCES) folder: exit 2, the path and the reason on stderr, no traceback, the
    old file byte for byte, no temporary file left."""
    out = tmp_path / "cap.safetensors"
    runner = CliRunner()
    assert runner.invoke(app, [*SYNTH, "-o", str(out)]).exit_code == 0
    before = out.read_bytes()

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    if where == "fsync":
        monkeypatch.setattr(files.os, "fsync", refuse)
    else:
        monkeypatch.setattr(files.tempfile, "mkstemp", refuse)
    r = runner.invoke(app, [*SYNTH, "--seed", "2", "--force", "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert f"kdtree: error: {out}: {os.strerror(code)}" in r.output and "Traceback" not in r.output
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_an_oserror_that_names_no_file_is_still_a_bug(monkeypatch):
    """Only a refusal about a named file is the machine's; an OSError from nowhere is kdtree's bug: exit 3."""
    from kdtree import synth as synth_module

    def broken(*args, **kwargs):
        raise OSError("no file in sight")

    monkeypatch.setattr(synth_module, "synthesize", broken)
    r = CliRunner().invoke(app, [*SYNTH, "-o", "/tmp/never-written.safetensors"])
    assert r.exit_code == 3 and "this is a bug" in r.output


# ----- hostile captures: small files whose header or tensors lie --------------------------------------
def _base():
    from conftest import small

    cap = small()
    return cap.tensor_dict(), cap.meta


def _meta(**kw):
    def make():
        t, m = _base()
        return t, dataclasses.replace(m, **kw)

    return make


def _tensor(name, change):
    def make():
        t, m = _base()
        t[name] = change(t[name].clone(), t)
        return t, m

    return make


def _nan_at(index):
    def change(x, t):
        x.view(-1)[index] = float("nan")
        return x

    return change


def _nan_pool_row(x, t):
    row = int(torch.searchsorted(t["kv_buffer_slots"], t["kv_indices"][3]))  # a prefix slot the step reads
    x[row, 0, 7] = float("nan")
    return x


# name -> (the capture, exit of `kdtree info`, exit of `kdtree diff --impl model --ref capture`, the rule named)
HOSTILE = {
    "pool_size at int32's limit": (_meta(pool_size=2**31 - 1), 0, 0, None),
    "pool_size past int32": (_meta(pool_size=2**40), 2, 2, "pool_size must be a whole number from 1 to"),
    "page_size huge": (_meta(page_size=10**9), 2, 2, "page_size must be a whole number from 1 to"),
    "sm_scale infinite": (_meta(sm_scale=float("inf")), 2, 2, "sm_scale must be a finite number > 0"),
    "sm_scale NaN": (_meta(sm_scale=float("nan")), 2, 2, "sm_scale must be a finite number > 0"),
    "logit_cap NaN": (_meta(logit_cap=float("nan")), 2, 2, "logit_cap must be a finite number"),
    "heads a bool": (_meta(num_heads=True), 2, 2, "num_heads must be a whole number"),
    "rank 256, not 512": (_meta(kv_lora_rank=256), 2, 2, "the verify kernel takes MLA's 512 and 64"),
    "model a number": (_meta(model=123), 2, 2, "model must be a string"),
    "tree_budget a string": (_meta(tree_budget="8"), 2, 2, "tree_budget must be a whole number"),
    "NaN in o": (_tensor("layers.0.o", _nan_at(5000)), 0, 2, "layers.0.o: non-finite value in token"),
    "NaN in a pool row read": (_tensor("layers.0.kv_buffer", _nan_pool_row), 2, 2, "non-finite value in the row of slot"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_capture_is_bad_input_never_a_bug_or_a_kernel_fail(tmp_path, name):
    """Each lie in a capture is exit 2 naming the rule - never 1 (blaming the kernel) or 3 (a traceback) - or, where
    the file is valid after all, a clean run."""
    from conftest import write_raw

    make, info_exit, diff_exit, rule = HOSTILE[name]
    tensors, meta = make()
    path = write_raw(tmp_path / "hostile.safetensors", tensors, meta)
    runner = CliRunner()
    for argv, want in ((["info", str(path)], info_exit), (["diff", str(path), "--impl", "model", "--ref", "capture"], diff_exit)):
        r = runner.invoke(app, argv)
        assert r.exit_code == want, (argv, r.output)
        assert "Traceback" not in r.output
        if want == 2:
            assert rule in r.output and str(path) in r.output, r.output


def _run_bounded(argv: list[str]) -> tuple[int, str, float, int]:
    """(exit, output, seconds, peak resident bytes) of `kdtree argv` in its own process."""
    import resource
    import subprocess
    import sys
    import time

    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kdtree", *argv], capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    return r.returncode, r.stdout + r.stderr, took, peak


def test_a_pool_size_claim_costs_nothing_and_a_far_slot_is_refused_by_name(tmp_path):
    """A 0.1 MB capture claiming a pool of 2^31 - 1 slots once made `diff --impl model` allocate ~2.5 TB; the pool
    is rebuilt only up to the highest stored slot. A stored slot near 2^31 (a 2.5 TB pool to keep the numbering)
    is exit 2 naming KDTREE_MAX_POOL_BYTES."""
    from conftest import write_raw

    t, m = _base()
    ok = write_raw(tmp_path / "claims.safetensors", t, dataclasses.replace(m, pool_size=2**31 - 1))
    code, out, took, peak = _run_bounded(["diff", str(ok), "--impl", "model"])
    assert code == 0 and took < 30 and peak < 1 << 30, (code, took, peak, out[-500:])
    far = 2**31 - 2  # move the last stored row (a draft slot) to the far end of the pool
    old = int(t["kv_buffer_slots"][-1])
    for name in ("kv_buffer_slots", "kv_indices", "out_cache_loc"):
        t[name] = torch.where(t[name] == old, far, t[name])
    path = write_raw(tmp_path / "far.safetensors", t, dataclasses.replace(m, pool_size=2**31 - 1))
    code, out, took, peak = _run_bounded(["diff", str(path), "--impl", "model"])
    assert code == 2 and "KDTREE_MAX_POOL_BYTES" in out and peak < 1 << 30, out[-500:]


def _many_requests(bs: int):
    """A valid capture of `bs` one-token requests with empty prefixes, one head: ~2.4 KB a request."""
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(bs, 1, 576, generator=g) * 0.1).to(torch.bfloat16)
    q = (torch.randn(bs, 1, 576, generator=g) * 0.1).to(torch.bfloat16)
    tensors = {
        "qo_indptr": torch.arange(bs + 1, dtype=torch.int32),
        "kv_indptr": torch.zeros(bs + 1, dtype=torch.int32),
        "kv_indices": torch.zeros(0, dtype=torch.int64),
        "out_cache_loc": torch.arange(1, bs + 1, dtype=torch.int64),
        "custom_mask": torch.ones(bs, dtype=torch.bool),
        "mask_indptr": torch.arange(bs + 1, dtype=torch.int64),
        "seq_lens": torch.zeros(bs, dtype=torch.int32),
        "kv_buffer_slots": torch.arange(1, bs + 1, dtype=torch.int64),
        "layers.0.q": q,
        "layers.0.k": k,
        "layers.0.o": k[..., :512].expand(bs, 1, 512).contiguous(),
        "layers.0.kv_buffer": k.clone(),
    }
    from kdtree.capture import CaptureMeta

    meta = CaptureMeta(num_heads=1, sm_scale=0.13, layer_ids=[0], pool_size=bs + 1, source={"kind": "synthetic"})
    return tensors, meta


def test_many_requests_in_a_few_megabytes_load_and_diff_in_seconds(tmp_path):
    """2,000 requests in a 9 MB file: validation runs over all of them at once (it looped per request in Python),
    `info` and `diff` finish well inside 30 s and 1 GB."""
    from conftest import write_raw

    path = write_raw(tmp_path / "many.safetensors", *_many_requests(2000))
    assert path.stat().st_size < 10e6
    for argv in (["info", str(path)], ["diff", str(path), "--impl", "model", "--ref", "capture"]):
        code, out, took, peak = _run_bounded(argv)
        assert code == 0 and took < 30 and peak < 1 << 30, (argv, code, took, peak, out[-300:])


def test_metadata_cannot_drive_the_terminal(tmp_path):
    """A model name with an escape sequence and a forged line prints escaped: no ESC byte, no extra line."""
    from conftest import write_raw

    t, m = _base()
    path = write_raw(tmp_path / "x.safetensors", t, dataclasses.replace(m, model="\x1b[2J\rPASS\nkdtree: all good"))
    r = CliRunner().invoke(app, ["info", str(path)])
    assert r.exit_code == 0 and "\x1b" not in r.output and "\r" not in r.output
    assert "\\x1b[2J\\rPASS\\nkdtree: all good" in r.output
    assert not any(line.startswith("kdtree: all good") for line in r.output.splitlines())


def test_a_file_name_that_is_not_utf8_is_read_and_shown_as_bytes(tmp_path):
    """A valid capture named with bytes that are not UTF-8 was refused ("not a readable safetensors file") and
    stopped its folder; it is read (through /proc/self/fd) and its name printed with \\xNN escapes."""
    from conftest import write_raw

    t, m = _base()
    write_raw(tmp_path / "good.safetensors", t, m)
    write_raw(os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xffbad.safetensors"), t, m)
    r = CliRunner().invoke(app, ["info", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert f"{tmp_path}/\\xffbad.safetensors" in r.output and f"{tmp_path}/good.safetensors" in r.output
