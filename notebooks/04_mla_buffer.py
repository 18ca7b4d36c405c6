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
# # MLA buffer layout
# The pool as SGLang's allocator left it: slot 0 (padding), free slots, each request's prefix slots and its
# draft slots (`out_cache_loc`). Then chosen rows as values: 512 latent columns (c_KV, also V) | 64 rope (k_pe).

# %%
from IPython.display import Image

from kdtree import plots
from kdtree.info import summarize
from kdtree.widgets import CapturePicker

picker = CapturePicker("mixed-prefix.safetensors")  # or type a capture file or directory of yours; re-run below
picker.widget

# %%
cap = picker.load()
m = cap.meta
codes = plots.pool_codes(m.pool_size + m.page_size, [cap.prefix_slots(b).numpy() for b in range(cap.batch_size)],
                         [cap.draft_slots(b).numpy() for b in range(cap.batch_size)])
Image(plots.to_png(plots.pool_figure(codes, cap.batch_size, width=64)))

# %%
s = summarize(cap)
print(f"{s['pool']['referenced_slots']} of {m.pool_size} slots referenced ({100 * s['pool']['occupancy']:.1f}%), "
      f"mean run of consecutive slots {s['pool']['mean_run_length']:.1f}")
for r in s["requests"]:
    print(f"request {r['request']}: prefix {r['prefix_len']:5d}, N {r['num_draft']}, {r['slot_runs']} runs of consecutive slots")

# %%
b = max(range(cap.batch_size), key=lambda r: int(cap.prefix_lens[r]))  # the request with the longest prefix
slots = [*map(int, cap.prefix_slots(b)[:2]), *map(int, cap.draft_slots(b)[:2])]
pool = cap.pool(0)
labels = [f"req {b} prefix"] * min(2, int(cap.prefix_lens[b])) + [f"req {b} draft"] * min(2, int(cap.num_draft[b]))
Image(plots.to_png(plots.kv_row_figure(pool[slots, 0].float().numpy(), slots, labels=labels)))

# %%
print("a slot nothing references is NaN in the rebuilt pool:", pool[int(codes.argmin()), 0, :4].tolist())
