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
# # Captured batches
# Pick a capture, validate it, summarise each request, and look at the raw SGLang tensors of one request.

# %%
from pathlib import Path

import kdtree
from kdtree.info import format_summary, summarize

CAPTURES = sorted(Path("../data/captured_batches").glob("*.safetensors"))
[p.name for p in CAPTURES]

# %%
cap = kdtree.load(CAPTURES[0])  # validates: a broken capture raises CaptureError naming the rule
print(format_summary(summarize(cap)))

# %% [markdown]
# ## The raw tensors of one request
# `kv_indices` holds the prefix slots only; the draft tokens' keys live at `out_cache_loc`.

# %%
b = 0
print("prefix slots (kv_indices slice):", cap.prefix_slots(b)[:16].tolist(), "...")
print("draft slots (out_cache_loc slice):", cap.draft_slots(b).tolist())
print("mask rows: shape", tuple(cap.mask_rows(b).shape), "(row stride = prefix_len + N)")
