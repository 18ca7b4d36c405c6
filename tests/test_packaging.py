"""kdtree as software: the wheel and the sdist carry the kernel sources, and the one rule that finds them
(kdtree.kernel.config.KERNEL_DIR: kdtree/kernels, a link to kernels/ in a checkout) gives the checkout's
kernels/ here, where an editable install runs.
.ci/run installs the wheel into a clean environment and runs the commands from outside the checkout."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from kdtree.kernel.config import KERNEL_DIR, source_files

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))


def test_the_kernel_sources_are_the_checkouts_here():
    """From a checkout (editable install, or PYTHONPATH) the sources are the ones you edit: kdtree/kernels is a
    link to kernels/, not a copy."""
    assert (ROOT / "kdtree" / "kernels").is_symlink() and KERNEL_DIR == ROOT / "kernels"
    assert {p.name for p in source_files()} <= set(KERNEL_FILES)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheel and the sdist of a clean copy of the checkout's tracked files (setuptools reuses a checkout's
    build/, where files of an earlier layout can linger)."""
    import shutil

    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "kdtree"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(src)], check=True, capture_output=True)
    for p in (ROOT / "kdtree").rglob("*.py"):  # the working tree's package, as the tests see it
        shutil.copy(p, src / p.relative_to(ROOT))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=out)
    sdist = "from setuptools import build_meta; import sys; build_meta.build_sdist(sys.argv[1])"
    subprocess.run([sys.executable, "-c", sdist, str(out)], check=True, capture_output=True, cwd=src)
    return next(out.glob("kdtree-*.whl")), next(out.glob("kdtree-*.tar.gz"))


def test_the_wheel_carries_every_kernel_source(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        assert sorted(n.removeprefix("kdtree/kernels/") for n in z.namelist() if n.startswith("kdtree/kernels/")) == KERNEL_FILES
        for name in KERNEL_FILES:
            assert z.read(f"kdtree/kernels/{name}") == (ROOT / "kernels" / name).read_bytes(), name
        assert not [n for n in z.namelist() if n.startswith(("tests/", "data/", "notebooks/"))]


def test_the_sdist_carries_every_kernel_source(built):
    _, sdist = built
    with tarfile.open(sdist) as t:
        names = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in t.getnames() if len(Path(n).parts) > 1}
    assert {f"kdtree/kernels/{n}" for n in KERNEL_FILES} <= names
