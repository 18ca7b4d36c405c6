"""JupyterLab in headless Chromium, driven as a user would: open the DDTree notebook, run all cells, change
the capture, request and node through the widgets, and check that the kernel-side state and the figure
changed. A screenshot is kept under test-artifacts/.

Needs Debian's chromium (/usr/bin/chromium) and the playwright package; skipped with the reason otherwise.
"""

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
NOTEBOOK = "03_ddtree_visibility.ipynb"  # a working copy `make lab` makes from 03_ddtree_visibility.py

REQUIRED = os.environ.get("KDTREE_REQUIRE_BROWSER") == "1"  # CI sets it: a missing browser fails, not skips
if not Path(CHROMIUM).exists():
    if REQUIRED:
        raise RuntimeError("KDTREE_REQUIRE_BROWSER=1 but /usr/bin/chromium is missing (apt-get install chromium)")
    pytest.skip("Debian's chromium is not installed (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`make lab`'s JupyterLab (kdtree.lab: the repository as root, notebooks made from their scripts) over a
    clone of the repository's committed tree plus the working tree's notebooks/, kdtree/ and tests, so the test
    can read `git status` there; token off, on loopback. Yields (url, clone)."""
    from kdtree.lab import command, ensure_notebooks
    from kdtree.server.process import free_port

    clone = tmp_path_factory.mktemp("lab") / "repo"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    for name in ("notebooks", "kdtree", "jupytext.toml", ".gitignore"):  # the working tree's, as a user has it
        src, dst = ROOT / name, clone / name
        if src.is_dir():
            shutil.rmtree(dst, ignore_errors=True)
            # symlinks kept: kdtree/kernels is a link to kernels/, which the kernel notebook's edit must reach
            shutil.copytree(
                src, dst, symlinks=True, ignore=shutil.ignore_patterns("*.ipynb", "__pycache__", ".ipynb_checkpoints")
            )
        else:
            shutil.copy(src, dst)
    subprocess.run(["git", "add", "-A"], cwd=clone, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "wt", "--allow-empty"], cwd=clone, check=True
    )
    ensure_notebooks(clone)
    port = free_port()
    cmd = command(clone, "127.0.0.1", port, browser=False, extra=["--ServerApp.token=", "--ServerApp.password=",
                                                                   "--ServerApp.disable_check_xsrf=True",
                                                                   f"--LabApp.workspaces_dir={clone.parent / 'workspaces'}"])  # fmt: skip
    log = open(clone.parent / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=clone, env={**os.environ, "PYTHONPATH": str(clone)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/lab", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.terminate()
        pytest.fail("JupyterLab did not start:\n" + (clone.parent / "lab.log").read_text()[-3000:])
    yield url, clone
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def set_slider(page, label: str, value: int) -> None:
    """Type a value into an ipywidgets 8 slider's readout (it is contentEditable)."""
    readout = page.locator(".widget-slider", has=page.locator(f"label:text-is('{label}')")).locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(str(value))
    page.keyboard.press("Enter")


def probe_state(page, previous: str = "") -> tuple[dict, str]:
    """Run the probe cell (it prints the explorer's state) and parse what it printed."""
    cell = page.locator(".jp-Notebook .jp-CodeCell", has_text="print(explorer.state)")
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")  # run in place (Shift+Enter on the last cell would add one)
    out = cell.locator(".jp-OutputArea-output").first
    page.wait_for_function(
        "([el, old]) => el.innerText.includes('ExplorerState') && el.innerText !== old",
        arg=[out.element_handle(timeout=30_000), previous],
        timeout=30_000,
    )
    text = out.inner_text()
    fields = dict(re.findall(r"(\w+)=('[^']*'|\d+)", text))
    return {k: v.strip("'") for k, v in fields.items()}, text


def first_image(page) -> str:
    return page.locator(".widget-output img").first.get_attribute("src")


def git_status(clone: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True).stdout


@contextmanager
def chromium_page(artifact: str):
    """A page of headless Chromium at 1400 x 1000; if the block fails, a screenshot goes to
    test-artifacts/`artifact`-failure.png."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"{artifact}-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def keep_and_save(page, artifact: str) -> None:
    """Keep a screenshot (test-artifacts/`artifact`.png), then save the notebook as a user does."""
    page.screenshot(path=str(ARTIFACTS / f"{artifact}.png"), full_page=True)
    page.keyboard.press("Control+s")
    page.wait_for_timeout(3000)


def open_and_run_all(page, url: str, notebook: str) -> None:
    """Open `notebook` in a workspace of its own (no tabs restored from another test) and run all its cells."""
    page.goto(f"{url}/lab/workspaces/{Path(notebook).stem}/tree/notebooks/{notebook}")
    page.wait_for_selector(".jp-Notebook:visible", timeout=60_000)
    try:  # a "Select Kernel" dialog may come first
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=8_000)
    except sync_api.TimeoutError:
        pass
    page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()


def test_ddtree_notebook_in_a_real_browser(lab):
    """Run it, explore through the widgets, save: the figure follows the selection, and the repository is as it
    was (the outputs live in the ignored .ipynb; the tracked script is unchanged)."""
    url, clone = lab
    with chromium_page("ddtree-notebook") as page:
        open_and_run_all(page, url, NOTEBOOK)
        page.wait_for_selector(".widget-slider", timeout=90_000)
        page.wait_for_selector(".widget-output img", timeout=60_000)
        before_img = first_image(page)
        before, before_text = probe_state(page)
        assert before["capture"] == "ddtree256.safetensors" and before["request"] == "0"

        page.locator(".widget-dropdown select").select_option("mixed-prefix.safetensors")
        page.wait_for_timeout(1500)
        set_slider(page, "request", 3)
        page.wait_for_timeout(1500)
        set_slider(page, "node", 7)
        page.wait_for_timeout(1500)
        after, _ = probe_state(page, before_text)
        after_img = first_image(page)
        keep_and_save(page, "ddtree-notebook")
        status = git_status(clone)
        if status:
            status += subprocess.run(["git", "diff"], cwd=clone, capture_output=True, text=True).stdout
    assert after["capture"] == "mixed-prefix.safetensors"
    assert (after["request"], after["node"]) == ("3", "7")
    assert int(after["renders"]) > int(before["renders"])
    assert after_img != before_img  # the figure was redrawn for the new selection
    saved = (clone / "notebooks" / NOTEBOOK).read_text()
    assert '"output_type"' in saved  # the save reached the working copy, with its outputs ...
    assert status == "", status  # ... and no tracked file changed
    (ARTIFACTS / "ddtree-notebook-state.json").write_text(json.dumps({"before": before, "after": after}))


def test_the_kernel_notebook_sees_an_edit_to_the_kernel(lab):
    """05 in the Lab: run it; break kernels/verify_mla.cu on disk and re-run the compile cell: the error quotes
    the edited line; restore it and re-run: the resources are back; the repository ends as it was."""
    url, clone = lab
    src = clone / "kernels" / "verify_mla.cu"
    original = src.read_text()
    with chromium_page("kernel-notebook") as page:
        open_and_run_all(page, url, "05_kernel_diff.ipynb")
        page.locator(".jp-OutputArea-output", has_text="registers HEAD -> edited").wait_for(timeout=240_000)
        cell = page.locator(".jp-Notebook .jp-CodeCell", has_text="compile_report(arch, config)")
        out = cell.locator(".jp-OutputArea-output")

        def rerun(expect: str) -> str:
            """Run the cell again until `expect` shows. A request that reaches ipykernel while it is still aborting
            the queue after the last run's error is aborted unrun (the prompt stays `[ ]:`): that run is asked
            again, up to twice."""
            shown = cell.locator(".jp-OutputArea-output", has_text=expect).first
            deadline, presses, idle_since = time.time() + 120, 0, None
            while not shown.is_visible():
                aborted = cell.locator(".jp-InputPrompt").inner_text().strip() == "[ ]:"
                idle_since = (idle_since or time.time()) if aborted else None
                if presses == 0 or (idle_since and time.time() - idle_since > 3 and presses < 3):
                    cell.locator(".jp-InputArea-editor").click()
                    page.keyboard.press("Control+Enter")
                    presses, idle_since = presses + 1, None
                assert time.time() < deadline, f"{expect!r} not shown after {presses} run(s) of the cell"
                page.wait_for_timeout(250)
            return "\n".join(out.all_inner_texts())

        try:
            src.write_text(original + "\n#error kdtree browser test: an edit the notebook must see\n")
            broken = rerun("kdtree browser test")
        finally:
            src.write_text(original)
        mended = rerun("verify_mla_fwd")
        keep_and_save(page, "kernel-notebook")
    assert "KernelCompileError" in broken and "does not compile" in broken
    assert "kdtree browser test" not in mended and "sm_120" in mended
    assert git_status(clone) == ""


def test_the_marshaling_notebook_states_the_real_stride_and_its_verdicts(lab):
    """02 in the Lab: the stride it prints is the request's prefix_len + N (from the capture, computed here), the
    faulted stride is named beside it, every figure renders, the verdicts are there, and saving leaves the
    repository clean."""
    from kdtree.capture import load
    from kdtree.marshal import marshal

    url, clone = lab
    cap = load(clone / "data/captured_batches/ddtree64-bs3.safetensors")  # the notebook's default pick
    b = min(1, cap.batch_size - 1)
    step, wrong = marshal(cap).steps[b], marshal(cap, "prefix-stride").steps[b]
    with chromium_page("marshaling-notebook") as page:
        open_and_run_all(page, url, "02_marshaling.ipynb")
        page.locator(".jp-OutputArea-output", has_text="prefix-only-kv:").first.wait_for(timeout=180_000)
        page.wait_for_function("document.querySelectorAll('.jp-OutputArea-output img').length >= 4", timeout=60_000)
        text = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        keep_and_save(page, "marshaling-notebook")
    p, n = step.prefix_len, step.num_draft
    assert f"row stride = prefix_len + N = {p} + {n} = {p + n}" in text
    assert f"prefix-stride reads rows at stride {wrong.mask_row_stride} instead of {p + n}" in text
    assert "correct         PASS (tolerance rel <= 0.01)" in text
    assert "prefix-only-kv  FAIL" in text and "prefix-stride   FAIL" in text
    assert git_status(clone) == ""


@pytest.mark.parametrize("notebook, images", [("01_captured_batches", 1), ("04_mla_buffer", 2), ("06_benchmark", 1)])
def test_a_notebook_runs_in_the_lab_and_draws_its_figures(lab, notebook, images):
    """01, 04 and 06 in the Lab: every cell runs without an error, the figures render (a screenshot is kept),
    and saving leaves the repository clean."""
    url, clone = lab
    with chromium_page(notebook) as page:
        open_and_run_all(page, url, f"{notebook}.ipynb")
        page.wait_for_function(f"document.querySelectorAll('.jp-OutputArea-output img').length >= {images}", timeout=120_000)
        page.wait_for_selector(".jp-Notebook:visible .jp-InputArea-prompt:has-text('[*]')", state="detached", timeout=120_000)
        text = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        keep_and_save(page, notebook)
    assert "Traceback" not in text and "Error" not in text, text[-2000:]
    assert git_status(clone) == ""


def test_the_lab_serves_the_kernels_and_the_data(lab):
    """`make lab` serves the repository: the kernel notebook 05 asks you to edit, and the captures, open in it."""
    url, _ = lab
    for path in ("kernels/verify_mla.cu", "data/captured_batches", "notebooks/05_kernel_diff.ipynb"):
        with urllib.request.urlopen(f"{url}/api/contents/{path}?content=0", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["path"] == path
