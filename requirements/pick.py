"""Which build of torch (and CuPy) `make` installs on this machine: `cuda13` where the NVIDIA driver runs CUDA 13
(driver 580 or newer), `cuda12` where it runs only CUDA 12 (525 or newer), `cpu` where there is none. Prints
`BUILD reason` on one line; standard library only (it runs before the environment exists).
Usage: python3 requirements/pick.py"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

PROC_VERSION = Path("/proc/driver/nvidia/version")
CUDA13_DRIVER = 580  # the oldest Linux driver of CUDA 13.0
CUDA12_DRIVER = 525  # the oldest Linux driver CUDA 12.x runs on (minor-version compatibility)


def driver_version(proc: Path = PROC_VERSION, smi: str | None = "nvidia-smi") -> str | None:
    """The NVIDIA kernel driver's version ("580.65.06"), from the kernel module or nvidia-smi; None without one."""
    try:
        if m := re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+(?:\.\d+)+)", proc.read_text()):
            return m.group(1)
    except OSError:
        pass
    if smi and shutil.which(smi):
        try:
            r = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode == 0 and (m := re.match(r"\s*(\d+(?:\.\d+)+)", r.stdout)):
            return m.group(1)
    return None


def pick(driver: str | None) -> tuple[str, str]:
    """(build, why) for a driver version (None: no driver)."""
    if driver is None:
        return "cpu", "no NVIDIA driver found"
    major = int(driver.split(".")[0])
    if major >= CUDA13_DRIVER:
        return "cuda13", f"NVIDIA driver {driver} runs CUDA 13"
    if major >= CUDA12_DRIVER:
        return "cuda12", f"NVIDIA driver {driver} runs CUDA 12, not 13 (580 or newer)"
    return "cpu", f"NVIDIA driver {driver} is older than CUDA 12's ({CUDA12_DRIVER})"


if __name__ == "__main__":
    build, why = pick(driver_version())
    print(build, why)
    sys.exit(0)
