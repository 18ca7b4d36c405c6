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
# # DDTree visibility
# Pick a capture, a request and a node: the mask (whole, downsampled without losing isolated cells, or the
# N x N draft block) and the tree drawn from it (parent = deepest proper ancestor), the node's row and its
# path to the root highlighted. Below the figures: the loader's tree checks, per request. The shipped captures are
# in the list; type a capture file or directory of yours in the `add` box to explore it.

# %%
from pathlib import Path

from kdtree.widgets import DDTreeExplorer

explorer = DDTreeExplorer(sorted(Path("../data/captured_batches").glob("*.safetensors")))
explorer.widget

# %%
# what the widgets last drew (kernel-side state)
print(explorer.state)
