"""The fault drill (CPU): hostile files and a hostile machine against kdtree's promises - bad input is exit 2 with
one line naming the file and why, a bug alone is exit 3, nothing is lost or half-written. The server-side faults
(a bad verdict cache, a bad setting, a full capture disk) are in tests/test_sglang_cpu.py and test_selfcheck.py."""

from __future__ import annotations

import errno
import os

import pytest
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
