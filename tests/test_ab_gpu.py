"""kdtree.ab on a GPU: two kernel source trees, each built as its own module and run side by side on a shipped
capture, as notebook 05's A/B cell does after an edit."""

import re
import shutil

import pytest

from kdtree.capture import load
from kdtree.kernel.config import KERNEL_DIR, SOURCE

from conftest import SHIPPED

pytestmark = pytest.mark.gpu


def test_an_edited_copy_and_the_kernel_run_side_by_side_each_its_own_module(tmp_path):
    """`a` is a copy of kernels/ with the softmax scale halved (an edit the oracle must catch); `b` is the kernel as
    it stands. (`committed_source` needs git, which the device's copy of the tree lacks; its CPU test covers it.)"""
    from kdtree.ab import run_ab
    from kdtree.kernel import VerifyKernel

    shutil.copytree(KERNEL_DIR, tmp_path / KERNEL_DIR.name)
    edited = tmp_path / KERNEL_DIR.name / SOURCE.name
    text = edited.read_text()
    halved, n = re.subn(r"\bsm_scale,(\s+)logit_cap,", r"sm_scale * 0.5f,\1logit_cap,", text)  # Args' initialiser
    assert n == 1, "the edit's target moved: update this test"
    edited.write_text(halved)

    cap = load(next(p for p in SHIPPED if "mixed" in p.name))
    rows = run_ab([cap], edited)
    assert VerifyKernel.get(source=edited) is not VerifyKernel.get(source=SOURCE)  # two modules
    for row in rows:
        assert row["rel_b"] < 1e-2, row  # the kernel as it stands
        assert row["rel_a"] > 5e-2, row  # the edit shows, in its own module only
        assert row["ms_a"] > 0 and row["ms_b"] > 0
