"""JupyterLab in headless Chromium, driven as a user would: open the DDTree notebook, run all cells, change
the capture, request and node through the widgets, and check that the kernel-side state and the figure
changed. A screenshot is kept under test-artifacts/.

Needs Debian's chromium (/usr/bin/chromium) and the playwright package; skipped with the reason otherwise.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
NOTEBOOK = "03_ddtree_visibility.ipynb"

REQUIRED = os.environ.get("KDTREE_REQUIRE_BROWSER") == "1"  # CI sets it: a missing browser fails, not skips
if not Path(CHROMIUM).exists():
    if REQUIRED:
        raise RuntimeError("KDTREE_REQUIRE_BROWSER=1 but /usr/bin/chromium is missing (apt-get install chromium)")
    pytest.skip("Debian's chromium is not installed (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on loopback over a copy of the notebooks (so autosave never touches the repository)."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    (root / "data").mkdir()
    (root / "data" / "captured_batches").symlink_to(ROOT / "data" / "captured_batches")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        "--ServerApp.token=",
        "--ServerApp.password=",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=",
        "--ServerApp.disable_check_xsrf=True",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
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
        pytest.fail("JupyterLab did not start:\n" + (root / "lab.log").read_text()[-3000:])
    yield url
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
    page.keyboard.press("Shift+Enter")
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


def test_ddtree_notebook_in_a_real_browser(lab):
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
            page.goto(f"{lab}/lab/tree/notebooks/{NOTEBOOK}")
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            try:  # a "Select Kernel" dialog may come first
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=8_000)
            except sync_api.TimeoutError:
                pass
            page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
            page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
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
            page.screenshot(path=str(ARTIFACTS / "ddtree-notebook.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "ddtree-notebook-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert after["capture"] == "mixed-prefix.safetensors"
    assert (after["request"], after["node"]) == ("3", "7")
    assert int(after["renders"]) > int(before["renders"])
    assert after_img != before_img  # the figure was redrawn for the new selection
    (ARTIFACTS / "ddtree-notebook-state.json").write_text(json.dumps({"before": before, "after": after}))
