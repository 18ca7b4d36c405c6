"""Every notebook runs top to bottom headless, and is committed without outputs, in sync with its script."""

from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_clean_and_in_sync(path: Path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    script = path.with_suffix(".py")
    assert script.exists(), f"{path.name} has no paired py:percent script"
    paired = jupytext.read(script)
    assert [c.source for c in paired.cells] == [c.source for c in nb.cells], (
        f"{path.name} and {script.name} differ: run `jupytext --sync`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless(path: Path, monkeypatch):
    # the kernel inherits the environment: a crash prints its Python traceback to stderr; a stuck cell is
    # interrupted after the timeout, so its KeyboardInterrupt traceback says where it stuck
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    nb = nbformat.read(path, as_version=4)
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
