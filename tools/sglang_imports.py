"""Which names SGLang's import chain asks of `sgl_kernel` (for the test harness's shim): imports the Triton
backend, the MLA pool, the attention test kit, the plugin loader and the server argument parser with the shim
and prints the names asked of it. Run where SGLang is importable and sgl_kernel is not,
with tests/ on PYTHONPATH (tools/gpu_session.sh sglang)."""

import sglang_harness  # noqa: E402

sglang_harness.install_sgl_kernel_shim()
for mod in (
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.test.kits.attention_unittest.attention_methods.mla_attention",
    "sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
    "kdtree.sglang.backend",
):
    try:
        __import__(mod)
        print(f"imported {mod}")
    except Exception as e:  # noqa: BLE001 - report and go on: the point is the list below
        print(f"FAILED {mod}: {type(e).__name__}: {e}")
print("sgl_kernel names asked for:", sorted(set(sglang_harness.REQUESTED)))
