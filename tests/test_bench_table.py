"""kdtree bench's table from a result (no GPU: results are built or read from the shipped logs)."""

import json
from pathlib import Path

from kdtree.bench import summary_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_names_the_kernel_sources_that_ran():
    """A result records the hash of the kernel sources it ran (`kernel_sources`, `kdtree.kernel.config.source_hash`)
    and the table's first line names it; a result without one (from before it was recorded) has no such line."""
    result = json.loads((ROOT / "docs/bench/bench-h200.json").read_text())
    result.pop("kernel_sources", None)
    assert summary_table(result).splitlines()[0].startswith("NVIDIA H200: bf16 matmul")
    result["kernel_sources"] = "0123456789abcdef"
    assert summary_table(result).splitlines()[0].startswith("kernels 0123456789abcdef; NVIDIA H200: bf16 matmul")
