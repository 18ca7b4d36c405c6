"""The README's commands that need no GPU run as written, from a fresh working directory, and exit as the README
says (`(exit N)` in the line's comment, else 0). `kdtree compile` is left to CI's own step (.ci/run runs the
README's line); GPU commands (bench, server-check, tune, report) and selfcheck (minutes on the CPU; its own tests
are in test_selfcheck.py) are not run here."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT

GPU_ONLY = (
    "kdtree bench",
    "kdtree server-check",
    "kdtree compile",
    "--impl cuda",
    "kdtree tune",
    "kdtree report",
    "kdtree selfcheck",
)


def readme_commands() -> list[tuple[str, int]]:
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith("kdtree ") or any(g in line for g in GPU_ONLY):
                continue
            command, _, comment = line.partition("#")
            m = re.search(r"\(exit (\d)\)", comment)
            out.append((command.strip(), int(m.group(1)) if m else 0, re.search(r"rel ([\d.]+)-([\d.]+)", comment)))
    return out


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_run():
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize("command, code, rel_range", COMMANDS, ids=[c for c, _, _ in COMMANDS])
def test_a_readme_command_runs_as_written(command, code, rel_range, tmp_path):
    (tmp_path / "data").symlink_to(ROOT / "data")  # the README's paths, outside the repository
    argv = [sys.executable, "-m", "kdtree", *shlex.split(command)[1:]]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == code, f"{command}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    if rel_range:  # "rel A-B" in the comment: the least and greatest rel printed, at A's and B's decimals
        rels = [float(x) for x in re.findall(r"\] L\d+ .* rel=(\S+)", r.stdout)]
        for printed, said in ((min(rels), rel_range[1]), (max(rels), rel_range[2])):
            decimals = len(said.partition(".")[2])
            assert f"{printed:.{decimals}f}" == said, f"{command}: README says rel {said}, the run printed {printed}"
