"""`tools/gpu_session.sh`, the one call a GPU machine gets: its parts are the ones its usage line names, and a word
that names none stops the call before it installs, compiles or writes anything (a typo costs no device time)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tools" / "gpu_session.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def usage_parts() -> set[str]:
    line = SCRIPT.read_text().splitlines()[2]
    return set(re.search(r"\[(.*)\]", line).group(1).split("|"))


def test_every_part_the_usage_line_names_has_a_case_and_no_case_is_unnamed():
    cases = set()
    for m in re.finditer(r"^    ([a-z0-9|-]+)\)", SCRIPT.read_text(), re.M):
        cases |= set(m.group(1).split("|"))
    assert usage_parts() - {"all"} == cases


def test_a_part_it_does_not_have_stops_the_call_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(SCRIPT), "smoke", "gpu-suit"],
        cwd=tmp_path,
        env=dict(os.environ, OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no part named 'gpu-suit'" in r.stderr and "gpu-suite" in r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
