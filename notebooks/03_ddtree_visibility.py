# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # DDTree visibility
# Pick a capture, a request and a node: the mask (whole, downsampled without losing isolated cells, or the
# N x N draft block) and the tree drawn from it (parent = deepest proper ancestor), the node's row and its
# path to the root highlighted. Below the figures: the loader's tree checks, per request.

# %%
from pathlib import Path

from kdtree.widgets import DDTreeExplorer

explorer = DDTreeExplorer(sorted(Path("../data/captured_batches").glob("*.safetensors")))
explorer.widget

# %%
# what the widgets last drew (kernel-side state)
print(explorer.state)
