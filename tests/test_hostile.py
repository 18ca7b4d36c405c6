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
    "NaN in a pool row read": (_tensor("layers.0.kv_buffer", _nan_pool_row), 2, 2, "in the row of slot"),
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


# runs `python -m kdtree ARGV` and, at exit, prints the process's peak resident memory: VmHWM, which exec resets
# (ru_maxrss would carry the forking test process's size into the child)
_PEAK = (
    "import atexit, runpy, sys\n"
    "def peak():\n"
    "    kb = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "    sys.stderr.write(f'\\nkdtree-peak-kb {kb}\\n')\n"
    "atexit.register(peak)\n"
    "sys.argv = ['kdtree', *sys.argv[1:]]\n"
    "runpy.run_module('kdtree', run_name='__main__')\n"
)


def _run_bounded(argv: list[str]) -> tuple[int, str, float, int]:
    """(exit, output, seconds, peak resident bytes) of `kdtree argv` in its own process."""
    import re
    import subprocess
    import sys
    import time

    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t
    peak = int(re.search(r"kdtree-peak-kb (\d+)", r.stderr).group(1)) * 1024
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


# ----- a hostile-input hunt's findings (a helper's run of ~1,000 hostile files and values) ---------------
def _raw_header(tmp_path, edit) -> str:
    """The base capture written again with its metadata JSON text edited by `edit` (no dataclass in between)."""
    from safetensors.torch import save_file

    from kdtree.capture import header_json

    t, m = _base()
    path = tmp_path / "raw.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, str(path), metadata={"kdtree": edit(header_json(m))})
    return str(path)


@pytest.mark.parametrize(
    "name,edit,rule",
    [
        (
            "JSON nested 100,000 deep",
            lambda s: s.replace('"kind": "synthetic"', '"kind": "synthetic", "x": ' + "[" * 100000 + "]" * 100000),
            "not a kdtree capture",
        ),
        (
            "a 401-digit sm_scale",
            lambda s: s.replace('"sm_scale": 0.130861', '"sm_scale": 1' + "0" * 400),
            "sm_scale must be a finite number",
        ),
        (
            "sm_scale 1e308",
            lambda s: s.replace('"sm_scale": 0.130861', '"sm_scale": 1e308'),
            "sm_scale must be a finite number > 0 and <= 16",
        ),
        ("logit_cap 1e308", lambda s: s.replace('"logit_cap": 0.0', '"logit_cap": 1e308'), "logit_cap must be a finite number"),
    ],
)
def test_metadata_that_breaks_parsers_or_arithmetic_is_named(tmp_path, name, edit, rule):
    path = _raw_header(tmp_path, edit)
    for argv in (["info", path], ["diff", path, "--impl", "model"]):
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2 and rule in r.output and "Traceback" not in r.output, (name, r.output[-400:])


def test_a_lone_surrogate_in_metadata_prints_escaped(tmp_path):
    path = _raw_header(tmp_path, lambda s: s.replace('"model": "Kimi-K2.x"', '"model": "\\ud800"'))
    r = CliRunner().invoke(app, ["info", path])
    assert r.exit_code == 0 and "model \\ud800" in r.output, r.output


def test_activations_no_fp32_attention_holds_are_bad_input_not_a_kernel_fail(tmp_path):
    """q of 3.3e38 (a finite bf16) overflowed every implementation, so diff said FAIL (exit 1) for no kernel."""
    from conftest import write_raw

    t, m = _base()
    t["layers.0.q"] = torch.full_like(t["layers.0.q"], 3.3e38)
    path = write_raw(tmp_path / "q.safetensors", t, m)
    r = CliRunner().invoke(app, ["diff", str(path), "--impl", "model"])
    assert r.exit_code == 2 and "layers.0.q: non-finite value or one past" in r.output, r.output


def test_the_pool_bound_is_parsed_as_ascii_and_names_the_top_slot(tmp_path, monkeypatch):
    from conftest import write_raw

    t, m = _base()
    path = write_raw(tmp_path / "c.safetensors", t, m)
    monkeypatch.setenv("KDTREE_MAX_POOL_BYTES", "²")
    r = CliRunner().invoke(app, ["diff", str(path), "--impl", "model"])
    assert r.exit_code == 2 and "KDTREE_MAX_POOL_BYTES" in r.output, r.output
    monkeypatch.setenv("KDTREE_MAX_POOL_BYTES", "0")
    r = CliRunner().invoke(app, ["diff", str(path), "--impl", "model"])
    assert r.exit_code == 2 and f"slot {int(t['kv_buffer_slots'].max()):,} makes a pool" in r.output, r.output


@pytest.mark.parametrize(
    "options,rule",
    [
        (["--seed", "-1"], "seed must lie in"),
        (["--topk", "-1"], "topk must lie in [1, 64]"),
        (["--topk", "1000000000"], "topk must lie in [1, 64]"),
        (["--max-depth", "1000000000"], "max_depth must lie in [1, 64]"),
        (["--pool-size", "2000000000"], "pool_size must lie in"),
        (["--batch", "1000000000"], "batch_size must be >= 1 and at most 1024"),
        (["--layers", "99999"], "layers must be distinct layer numbers from 0 to"),
        (["--logit-cap", "nan"], "logit_cap must be a finite number"),
        (["--prefix", "1048576", "--batch", "4"], "the batch reads"),
    ],
)
def test_synth_refuses_what_would_exhaust_the_machine_and_writes_nothing(tmp_path, options, rule):
    out = tmp_path / "s.safetensors"
    r = CliRunner().invoke(app, ["synth", "-o", str(out), "--budget", "8", *options])
    assert r.exit_code == 2 and rule in r.output and "Traceback" not in r.output, r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_synth_names_its_output_and_replaces_only_a_regular_file(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    r = CliRunner().invoke(app, [*SYNTH, "--force", "-o", str(folder)])
    assert r.exit_code == 2 and f"{folder} is not a regular file" in r.output, r.output
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    r = CliRunner().invoke(app, [*SYNTH, "--force", "-o", str(fifo)])
    assert r.exit_code == 2 and "not a regular file" in r.output and fifo.is_fifo()


def test_a_forged_verdict_row_prints_escaped_and_huge_numbers_are_refused(tmp_path, monkeypatch):
    """A cached verdict whose row name forges a PASS line prints with its control characters escaped; one whose
    tolerance is a 401-digit integer, or that is nested 100,000 deep, is ignored by name and checked again."""
    import json

    from kdtree import selfcheck

    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(selfcheck.SKIP_VAR, raising=False)
    good = selfcheck.ensure("model", captures=[], seeds=(17,)).verdict.to_json()
    path = selfcheck.verdict_path(selfcheck.current_key("model"))
    path.write_text(json.dumps({**good, "rows": [{**good["rows"][0], "name": "\x1b[31mX\nPASS: everything fine\r"}]}))
    text = selfcheck.format_verdict(selfcheck.load(selfcheck.current_key("model")))
    assert "\x1b" not in text and "\nPASS: everything fine" not in text and "\\nPASS: everything fine\\r" in text
    for body in (json.dumps(good).replace('"tolerance": 0.01', '"tolerance": 1' + "0" * 400), "[" * 100000 + "]" * 100000):
        path.write_text(body)
        o = selfcheck.ensure("model", captures=[], seeds=(17,))
        assert o.verdict.passed and o.notes and o.notes[0].startswith("cached verdict ignored"), o.notes


@pytest.mark.parametrize(
    "body", ["[" * 100000 + "]" * 100000, '{"format": "kdtree-tune/1", "gpu": "G", "sms": Infinity}', "long name"]
)
def test_a_tuning_file_that_breaks_parsers_is_said_and_ignored(tmp_path, caplog, body):
    from kdtree.kernel import tuning

    path = tmp_path / ("x" * 300 if body == "long name" else "tune.json")
    if body != "long name":
        path.write_text(body)
    tuning._active.clear()
    with caplog.at_level("WARNING", logger="kdtree"):
        assert tuning.active_tuning("G", 132, "", {"KDTREE_TUNING": str(path)}) is None
    assert "tuning file not used" in caplog.text
