"""The set-up's own logic: requirements/pick.py (which build `make` installs, from the NVIDIA driver) and the
locks it installs (requirements/BUILD.txt: every package pinned, the .in's torch among them)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pick", ROOT / "requirements" / "pick.py")
pick = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick)

PROC_580 = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Thu Oct 2\nGCC version:  gcc version 12.2.0\n"
PROC_570 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed Jan 22 2025\n"


@pytest.mark.parametrize(
    "proc,driver,build",
    [(PROC_580, "580.159.04", "cuda13"), (PROC_570, "570.86.15", "cuda12"), (None, None, "cpu")],
)
def test_the_build_follows_the_driver(tmp_path, proc, driver, build):
    path = tmp_path / "version"
    if proc is not None:
        path.write_text(proc)
    assert pick.driver_version(path, smi=None) == driver
    got, why = pick.pick(driver)
    assert got == build and (driver or "no NVIDIA driver") in why


def test_an_old_driver_gets_the_cpu_build():
    assert pick.pick("470.256.02")[0] == "cpu"


def test_nvidia_smi_is_asked_where_the_kernel_module_says_nothing(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 575.57.08\n")
    smi.chmod(0o755)
    assert pick.driver_version(tmp_path / "absent", smi=str(smi)) == "575.57.08"


def test_the_script_prints_one_line_build_and_why():
    out = subprocess.run([sys.executable, str(ROOT / "requirements" / "pick.py")], capture_output=True, text=True, check=True)
    build, why = out.stdout.strip().split(" ", 1)
    assert build in ("cpu", "cuda12", "cuda13") and why and out.stdout.count("\n") == 1


@pytest.mark.parametrize("build", ["cpu", "cuda13"])
def test_each_lock_pins_every_package_and_the_builds_torch(build):
    """Every line of a lock is `name==version` (a lock that floats is none), and its torch is the .in's."""
    lines = [ln for ln in (ROOT / "requirements" / f"{build}.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", ln) for ln in lines), lines
    (torch_in,) = [ln for ln in (ROOT / "requirements" / f"{build}.in").read_text().splitlines() if ln.startswith("torch")]
    assert torch_in in lines
    assert not [ln for ln in lines if ln.startswith(("kdtree==", "pip=="))]
