"""No false PASS: an edited kernel is never called PASS where it did not run. Without a GPU, `kdtree diff` runs the
kernel's torch model, which never reads the .cu; an edit that changes the compiled kernel (its PTX against HEAD's,
from NVRTC) turns the verdict into NOT RUN. On a GPU the same edit FAILs against the oracle."""

import shutil
import subprocess
import sys

import pytest

from kdtree import ab
from kdtree.ab import edits_against, model_verdict
from kdtree.kernel.config import KERNEL_DIR

from conftest import SHIPPED

pytest.importorskip("cuda.bindings", reason="NVRTC not installed (pip install -e '.[nvrtc]')")

BUG = ("const float scale_log2 = a.sm_scale * LOG2E;", "const float scale_log2 = 2.0f * a.sm_scale * LOG2E;")
CAPTURE = next(p for p in SHIPPED if p.stem == "mixed-prefix")


@pytest.fixture
def checkout(tmp_path):
    """A git checkout of kdtree's package and kernels (kdtree/kernels the link to kernels/, as in the repository),
    committed, then the softmax scale doubled in kernels/verify_mla_common.cuh - a real kernel bug."""
    repo = tmp_path / "repo"
    shutil.copytree(KERNEL_DIR, repo / "kernels")
    shutil.copytree(KERNEL_DIR.parent / "kdtree", repo / "kdtree", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "kernels"], check=True)
    common = repo / "kernels" / "verify_mla_common.cuh"
    text = common.read_text()
    assert BUG[0] in text
    common.write_text(text.replace(BUG[0], BUG[1]))
    return repo


def test_an_edit_that_changes_the_kernel_is_not_run_never_pass(checkout):
    changes = edits_against(source=checkout / "kernels" / "verify_mla.cu")
    assert changes and any(c.startswith("sm_120") for c in changes), changes
    word, sentence = model_verdict(True, changes)
    assert word == "NOT RUN" and "says nothing of the edit" in sentence
    subprocess.run(["git", "-C", str(checkout), "checkout", "-q", "--", "kernels"], check=True)
    assert edits_against(source=checkout / "kernels" / "verify_mla.cu") == []


def test_kdtree_diff_on_a_cpu_does_not_say_pass_for_the_edited_kernel(checkout, tmp_path):
    """The command as a user runs it in that checkout (the package from there): the model's diff passes, as it must
    (it never reads the .cu), and the verdict line says NOT RUN, not PASS."""
    r = subprocess.run(
        [sys.executable, "-m", "kdtree", "diff", str(CAPTURE), "--impl", "model"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    verdict = [line for line in r.stdout.splitlines() if "layer(s) of" in line]
    assert r.returncode == 1 and verdict and verdict[0].startswith("NOT RUN:"), r.stdout + r.stderr
    assert "PASS:" not in r.stdout


def test_an_edit_that_does_not_compile_fails_and_no_nvrtc_compares_nothing(checkout, monkeypatch):
    """A kernel edit that does not compile is FAIL (it once ended `kdtree diff` in a traceback); a machine without
    NVRTC compares nothing (MODEL PASS), never PASS."""
    source = checkout / "kernels" / "verify_mla.cu"
    common = checkout / "kernels" / "verify_mla_common.cuh"
    common.write_text(common.read_text() + "\n#error an edit that does not compile\n")
    monkeypatch.setattr(ab, "edits_against", lambda real=ab.edits_against: real(source=source))
    word, note = ab.diff_verdict(True, "model")
    assert word == "FAIL" and "does not compile" in note

    def no_nvrtc(*args, **kwargs):
        raise RuntimeError("cross-compiling needs NVRTC")

    monkeypatch.setattr(ab, "ptx_changes", no_nvrtc)
    assert ab.diff_verdict(True, "model")[0] == "MODEL PASS"


def test_without_a_checkout_the_model_verdict_says_what_it_is():
    assert model_verdict(True, None)[0] == "MODEL PASS"
    assert model_verdict(False, ["sm_120 mma32"])[0] == "FAIL"


@pytest.mark.gpu
def test_on_a_gpu_the_edited_kernel_fails_the_oracle(checkout):
    from kdtree.ab import committed_source, run_ab
    from kdtree.capture import load

    rows = run_ab([load(CAPTURE)], committed_source("HEAD", checkout), checkout / "kernels" / "verify_mla.cu", timed=False)
    assert all(r["rel_a"] < 1e-2 for r in rows) and all(r["rel_b"] > 1e-2 for r in rows), rows
