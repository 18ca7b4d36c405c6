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
# # Marshaling, step by step
# From SGLang's TARGET_VERIFY tensors to what the verify kernel reads, for one request - then the two
# historical bugs injected beside the correct path.

# %%
from IPython.display import Image

from kdtree import plots
from kdtree.impls import diff_capture
from kdtree.marshal import FAULTS, marshal, unpack_bits
from kdtree.widgets import CapturePicker

picker = CapturePicker("ddtree64-bs3.safetensors")  # or type a capture file or directory of yours; re-run below
picker.widget

# %%
cap = picker.load()
b = min(1, cap.batch_size - 1)  # the request this notebook follows
args = marshal(cap)
step = args.steps[b]
print(cap)

# %% [markdown]
# **1. The prefix slots** are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`: committed tokens only.

# %%
print(f"kv_indptr[{b}:{b + 2}] = {cap.kv_indptr[b:b + 2].tolist()}  ->  prefix_len = {step.prefix_len}")
print("prefix slots:", step.prefix_slots[:12].tolist(), "...", step.prefix_slots[-4:].tolist())

# %% [markdown]
# **2. The draft tokens' keys** were written by `set_kv_buffer` at `out_cache_loc` before attention ran.

# %%
print(f"qo_indptr[{b}:{b + 2}] = {cap.qo_indptr[b:b + 2].tolist()}  ->  N = {step.num_draft}")
print("draft slots (out_cache_loc slice):", step.draft_slots.tolist())

# %% [markdown]
# **3. The combined list** the kernel walks: prefix ++ drafts, `prefix_len + N` keys.

# %%
kvp = args.combined_kv_indptr.tolist()
print(f"combined_kv_indptr[{b}:{b + 2}] = {kvp[b:b + 2]}  (= cumsum of prefix_len + N)")
print("last keys of the combined list:", step.combined_slots[-(step.num_draft + 3):].tolist())

# %% [markdown]
# **4. The mask block** of request b starts at `mask_indptr[b]`; its rows are `prefix_len + N` long, because
# every row holds the prefix columns and then the draft columns. Row i, draft column j is at
# `mask_indptr[b] + i * (prefix_len + N) + prefix_len + j`.

# %%
print(f"mask_indptr[{b}] = {step.mask_start}, row stride = prefix_len + N = {step.prefix_len} + {step.num_draft} = {step.mask_row_stride}")
Image(plots.to_png(plots.mask_figure(cap.mask_rows(b).numpy(), step.prefix_len, zoom=(0, step.num_draft, step.prefix_len - 40, step.mask_row_stride), title=f"request {b}'s rows, the end of the prefix and the draft columns")))

# %% [markdown]
# **5. The extracted tree block**, packed to bits per row (`tree_mask`), unpacked here: every node sees itself
# and its ancestors.

# %%
block = unpack_bits(args.tree_mask[int(cap.qo_indptr[b]) : int(cap.qo_indptr[b + 1])], step.num_draft)
assert (block == cap.tree_block(b)).all()
Image(plots.to_png(plots.mask_figure(block.numpy(), step.prefix_len, first_col=step.prefix_len, title=f"request {b}'s draft block, unpacked from tree_mask bits")))

# %% [markdown]
# ## The two historical bugs
# Same capture, marshaled wrongly, run through the torch model of the kernel and diffed against the fp64 oracle.

# %%
for fault, what in [(None, "correct")] + list(FAULTS.items()):
    (d,) = diff_capture(cap, "model", fault=fault, device="cpu")
    verdict = "PASS" if d.passed else "FAIL"
    print(f"{fault or 'correct':15s} {verdict} (tolerance rel <= {d.tolerance:g}): {what}\n{'':15s} {d.line()}")

# %%
wrong = marshal(cap, "prefix-stride").steps[b]
print(f"prefix-stride reads rows at stride {wrong.mask_row_stride} instead of {step.mask_row_stride}: what the kernel would see")
Image(plots.to_png(plots.mask_fault_figure(step.tree_block.numpy(), wrong.tree_block.numpy(), step.prefix_len, wrong.mask_row_stride)))

# %%
only = marshal(cap, "prefix-only-kv").steps[b]
print(f"prefix-only-kv: {len(only.combined_slots)} keys instead of {len(step.combined_slots)}; the {step.num_draft} draft keys at out_cache_loc are never read")
Image(plots.to_png(plots.key_reads_figure(step.prefix_slots.numpy(), step.draft_slots.numpy(), only.combined_slots.numpy(), title=f"request {b}: the keys prefix-only-kv reads against the keys it must")))
