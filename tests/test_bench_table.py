"""kdtree bench's table from a result (no GPU: results are built or read from the shipped logs)."""

import json
from pathlib import Path

from kdtree.bench import summary_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_names_the_kernel_sources_that_ran():
    """A result records the hash of the kernel sources it ran (`kernel_sources`, `kdtree.kernel.config.source_hash`)
    and the table's first line names it; a result without one (from before it was recorded) has no such line."""
    result = json.loads((ROOT / "tests/fixtures/bench-h200.json").read_text())
    result.pop("kernel_sources", None)
    assert summary_table(result).splitlines()[0] == "NVIDIA H200"
    result["kernel_sources"] = "0123456789abcdef"
    assert summary_table(result).splitlines()[0] == "NVIDIA H200, kernels 0123456789abcdef"


def test_the_table_fits_a_notebook_and_explains_its_fractions_over_100_percent():
    result = json.loads((ROOT / "tests/fixtures/bench-h200.json").read_text())
    lines = summary_table(result).splitlines()
    assert max(map(len, lines)) <= 120  # no wrap in a 1400 px notebook
    assert any(l.startswith("%mma / %ldsm:") for l in lines)
