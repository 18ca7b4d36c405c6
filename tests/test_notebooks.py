"""Every notebook runs top to bottom headless. Notebooks are tracked as py:percent scripts only; their .ipynb are
working copies that `make lab` makes and git ignores, so exploring never writes outputs into a tracked file."""

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


@pytest.fixture
def jupytext():
    """The notebook stack (jupytext, nbclient): a dev install has it; the GPU machine's Python lacks it unless
    `tools/gpu_session.sh notebooks` carries it, and there the tests that run notebooks skip."""
    pytest.importorskip("nbclient", reason="needs nbclient (the notebook stack)")
    return pytest.importorskip("jupytext", reason="needs jupytext (the notebook stack)")


def test_notebooks_are_tracked_as_scripts_only():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "notebooks"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert tracked.split() and all(name.endswith(".py") for name in tracked.split()), tracked
    ignored = subprocess.run(["git", "check-ignore", "notebooks/01_captured_batches.ipynb"], cwd=ROOT, capture_output=True)
    assert ignored.returncode == 0, "notebooks/*.ipynb must be ignored"
    for script in NOTEBOOKS:
        head = script.read_text().split("# ---", 2)[1]
        assert "formats: ipynb,py:percent" in head and "jupytext_version:" not in head, script.name


def test_lab_makes_missing_notebooks_from_their_scripts(tmp_path, jupytext):
    from kdtree.lab import command, ensure_notebooks

    (tmp_path / "notebooks").mkdir()
    shutil.copy(NOTEBOOKS[0], tmp_path / "notebooks")
    (made,) = ensure_notebooks(tmp_path)
    assert made.suffix == ".ipynb" and [c.source for c in jupytext.read(made).cells] == [
        c.source for c in jupytext.read(NOTEBOOKS[0]).cells
    ]
    assert ensure_notebooks(tmp_path) == []  # an existing working copy (and its outputs) is kept
    cmd = command(tmp_path, "0.0.0.0", 8899, browser=False)
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--port=8899" in cmd and "--ip=0.0.0.0" in cmd
    assert "--ServerApp.default_url=/lab/tree/notebooks" in cmd


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless(path: Path, monkeypatch, jupytext):
    # the kernel inherits the environment: a crash prints its Python traceback to stderr; a stuck cell is
    # interrupted after the timeout, so its KeyboardInterrupt traceback says where it stuck
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    from nbclient import NotebookClient

    nb = jupytext.read(path)
    client = NotebookClient(
        nb,
        timeout=120,
        interrupt_on_timeout=True,
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}\n" + "\n".join(e.traceback[-6:]) for e in errors)
