"""The README's commands that need no GPU run as written, from a fresh working directory, and exit as the README
says (`(exit N)` in the line's comment, else 0). `kdtree compile` is left to CI's own step (.ci/run runs the
README's line); GPU commands (bench, server-check, selfcheck, tune, report) are not run here."""

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
            out.append((command.strip(), int(m.group(1)) if m else 0))
    return out


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_run():
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize("command, code", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_a_readme_command_runs_as_written(command, code, tmp_path):
    (tmp_path / "data").symlink_to(ROOT / "data")  # the README's paths, outside the repository
    argv = [sys.executable, "-m", "kdtree", *shlex.split(command)[1:]]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == code, f"{command}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
