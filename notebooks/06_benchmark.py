# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -kernelspec,-jupytext.text_representation.jupytext_version,-jupytext.text_representation.format_version
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Benchmark
# `kdtree bench` results: the kernel against SGLang's Triton kernel and plain torch, timed in the same run,
# with the roofline from ceilings measured in that run. The shipped result was measured on an H200
# (see docs/kernel-design.md); point `RESULT` at your own `bench.json` to see yours.

# %%
import json
from pathlib import Path

from IPython.display import Image

from kdtree import plots
from kdtree.bench import summary_table

RESULT = Path("../docs/bench/bench-h200.json")
result = json.loads(RESULT.read_text())
print(summary_table(result))

# %%
Image(plots.to_png(plots.bench_figure(result)))
