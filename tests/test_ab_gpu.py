"""kdtree.ab on a GPU: the committed kernel and the working tree's, each its own module, on a shipped capture."""

import pytest

from kdtree.capture import load

from conftest import SHIPPED

pytestmark = pytest.mark.gpu


def test_the_committed_and_the_edited_kernel_run_side_by_side():
    from kdtree.ab import committed_source, run_ab
    from kdtree.kernel import SOURCE, VerifyKernel

    head = committed_source("HEAD")
    cap = load(next(p for p in SHIPPED if "mixed" in p.name))
    (row,) = run_ab([cap], head)
    assert VerifyKernel.get(source=head) is not VerifyKernel.get(source=SOURCE)  # two modules
    assert row["rel_a"] < 1e-2 and row["rel_b"] < 1e-2 and row["ms_a"] > 0 and row["ms_b"] > 0
