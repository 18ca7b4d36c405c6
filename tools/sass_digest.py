"""SHA-256 of the SASS of each kernel (verify_mla_fwd, verify_mla_merge) for every target's configurations (NVRTC, then
nvdisasm): run before and after a source change that must not change the code (docs/kernel-design.md, "Switches that remain"). No GPU needed.

Usage: python3 tools/sass_digest.py [--nvrtc path/to/libnvrtc.so.13] [--nvdisasm path/to/nvdisasm]"""

import argparse
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from kdtree.kernel import KernelConfig, nvrtc_compile, nvrtc_version, use_nvrtc_library

TARGETS = (
    [("sm_120", c) for c in KernelConfig.candidates("sm_120")]
    + [("sm_90", c) for c in KernelConfig.candidates("sm_90")]
    + [("sm_100", c) for c in KernelConfig.candidates("sm_100")]
)


def sass(cubin: bytes, nvdisasm: str) -> dict[str, str]:
    """Each kernel's SASS: nvdisasm's text split at its `.text.<kernel>` sections."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
    parts = re.split(r"^\s*\.section\s+\.text\.(\w+)", text, flags=re.M)
    return {name: renumbered(code) for name, code in zip(parts[1::2], parts[2::2])}


def renumbered(code: str) -> str:
    """A kernel's SASS with its labels and internal helper functions numbered from 0 in order of appearance
    (nvdisasm numbers them across the file, so a change to one kernel would renumber the next one's)."""
    names: dict[str, str] = {}
    return re.sub(r"\.L_x_\d+|\$__internal_\d+_", lambda m: names.setdefault(m.group(), f"#{len(names)}"), code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", type=Path)
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    a = ap.parse_args()
    if a.nvrtc:
        use_nvrtc_library(a.nvrtc)
    print(f"NVRTC {nvrtc_version()}, {a.nvdisasm}")
    for arch, config in TARGETS:
        cubin, _ = nvrtc_compile(arch, config)
        digests = " ".join(
            f"{k} {hashlib.sha256(v.encode()).hexdigest()[:16]}" for k, v in sorted(sass(cubin, a.nvdisasm).items())
        )
        print(
            f"{arch:7s} bm{config.bm:<3d} wgmma={int(config.wgmma)} few_rows={config.few_rows:<3d} blocks64={int(config.blocks64)} {digests}"
        )


if __name__ == "__main__":
    main()
