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
# # Kernel diff
# Compile `kernels/verify_mla.cu` (registers, spills, shared memory), run it on captures and diff it
# against the fp64 oracle. Edit the `.cu` (or a header it includes: each segment body has its own
# `verify_mla_body_*.cuh`) and re-run: the change is picked up.
# The compile check builds every configuration sm_120 and sm_90 may run (and the present GPU's), as
# `kdtree compile` does. Without a GPU the kernel cannot run: the notebook says so and diffs the kernel's torch
# model instead (what `kdtree diff` runs there too: the kernel's marshaled arguments, its split
# and merge, in torch). The model never reads the `.cu`: an edit that changes the compiled kernel
# (its PTX against `HEAD`'s) is then NOT RUN, never PASS.

# %%
from IPython.display import Image

import kdtree
from kdtree import plots
from kdtree.ab import diff_verdict
from kdtree.diff import DEFAULT_TOLERANCE
from kdtree.impls import default_impl, diff_capture, gpu_available
from kdtree.kernel import KernelConfig, compile_report, device_arch
from kdtree.widgets import CapturePicker

GPU = gpu_available()
impl = default_impl()  # "cuda" with a GPU and CuPy, else "model": as `kdtree diff`
print(f"GPU: {device_arch()}: the CUDA kernel runs" if GPU else "GPU: none here: the kernel's torch model runs instead (impl=model)")
targets = ["sm_120", "sm_90"] + ([device_arch()] if GPU and device_arch() not in ("sm_120", "sm_90") else [])
reports = [
    r
    for arch in targets
    for config in KernelConfig.candidates(arch)  # every configuration the target may run (Hopper's as sm_90a)
    for r in compile_report(arch, config)  # a compile error raises KernelCompileError quoting the offending lines
]
print("\n".join(r.line() for r in reports))
print("all fit: no spills, shared memory within each target" if all(r.ok for r in reports) else "NOT OK: see the lines above")

# %%
picker = CapturePicker("dsv3-3layers.safetensors")  # or a capture file or directory of yours (a directory: all of it)
picker.widget

# %%
captures = picker.paths
results = {}
for path in captures:
    cap = kdtree.load(path)
    results[path.name] = (cap, diff_capture(cap, impl, "oracle"))
    print(f"{path.name}  impl={impl} ref=oracle")
    for d in results[path.name][1]:
        print("  " + d.line() + ("" if d.passed else "  FAIL"))
every = [d for _, ds in results.values() for d in ds]
word, note = diff_verdict(all(d.passed for d in every), impl)  # without a GPU: what the model's verdict says of your edit
print((f"note: {note}\n" if note else "") + f"{word}: {len(every)} layer(s) of {len(results)} capture(s), tolerance rel <= {DEFAULT_TOLERANCE:g}")

# %%
cap, diffs = next(iter(results.values()))  # the first capture's first layer
d = diffs[0]
depth = [int(cap.depths(b)[i]) for b in range(cap.batch_size) for i in range(int(cap.num_draft[b]))]
print("worst:", d.worst)
Image(plots.to_png(plots.error_map_figure(d.row_rel.numpy(), depth, request_starts=cap.qo_indptr[:-1].tolist(), title=f"{impl} vs oracle, layer {d.layer}: rel error per (node, head)")))

# %% [markdown]
# ## A/B: your edit against the committed kernel
# `kernels/` as `HEAD` has it is built as a second module beside your edited one: the resources on each target
# (no GPU needed), and on a GPU the error against the oracle and the time of each on the picked captures.
# Change `REF` to compare against another commit.

# %%
from kdtree.ab import committed_source, compile_ab, format_compile_ab, run_ab

REF = "HEAD"
committed = committed_source(REF)
print(format_compile_ab(compile_ab(targets, committed), names=(REF, "edited")))
if GPU:
    for r in run_ab([kdtree.load(p) for p in captures], committed):
        print(f"{r['capture']} L{r['layer']}: rel {r['rel_a']:.3e} -> {r['rel_b']:.3e}, {r['ms_a']:.3f} -> {r['ms_b']:.3f} ms")
else:
    print("no GPU here: error and time need one (the resources above are the kernels' own, from NVRTC)")
