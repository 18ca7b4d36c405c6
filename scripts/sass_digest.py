"""SHA-256 of the SASS of every kernel for every target's configurations (NVRTC, then nvdisasm): run before and
after a source change that must not change the code (docs/kernel-design.md, "Switches that remain"). No GPU needed.

Usage: python3 scripts/sass_digest.py [--nvrtc path/to/libnvrtc.so.13] [--nvdisasm path/to/nvdisasm]"""

import argparse
import hashlib
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


def sass(cubin: bytes, nvdisasm: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout


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
        digest = hashlib.sha256(sass(cubin, a.nvdisasm).encode()).hexdigest()[:16]
        print(
            f"{arch:7s} bm{config.bm:<3d} wgmma={int(config.wgmma)} few_rows={config.few_rows:<3d} blocks64={int(config.wg_blocks64)} {digest}"
        )


if __name__ == "__main__":
    main()
