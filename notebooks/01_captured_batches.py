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
# Pick a capture (a shipped one, or a file or directory of yours), validate it, summarise each request, and look at
# the raw SGLang tensors of one request. Change the picker, then re-run the cells below it.

# %%
from IPython.display import Image

from kdtree import plots
from kdtree.info import format_summary, summarize
from kdtree.widgets import CapturePicker

picker = CapturePicker("mixed-prefix.safetensors")  # a shipped capture, or type a file or directory of yours
picker.widget

# %%
cap = picker.load()  # validates: a broken capture raises CaptureError naming the rule
summary = summarize(cap)
print(format_summary(summary))
Image(plots.to_png(plots.requests_figure(summary)))

# %% [markdown]
# ## The raw tensors of one request
# `kv_indices` holds the prefix slots only; the draft tokens' keys live at `out_cache_loc`.

# %%
b = int(cap.prefix_lens.argmax())  # the request with the longest prefix (a request may have none)
print("prefix slots (kv_indices slice):", cap.prefix_slots(b)[:16].tolist(), "...")
draft = cap.draft_slots(b).tolist()
print(f"draft slots (out_cache_loc slice): {len(draft)} slots:", draft[:8], "..." if len(draft) > 8 else "")
print("mask rows: shape", tuple(cap.mask_rows(b).shape), "(row stride = prefix_len + N)")
