"""kdtree inside SGLang: `--attention-backend kdtree` (docs/sglang.md).

Nothing here imports SGLang at import time: `backend` does (it subclasses SGLang's Triton backend) and is
loaded only by the plugin's factory (`plugin`, SGLang's `sglang.srt.plugins` entry point). The other modules
are SGLang-free and tested on CPU: `settings` (the environment), `verify` (marshal, plan and launch for one
step), `shadow` (the per-layer diff line), `capture_hook` (bounded capture files). `triton_ref` calls SGLang's
Triton kernel on a capture, as the Triton backend does, for the workbench's references and benchmarks.
"""

from kdtree.sglang.triton_ref import extend_attention, run, verify_call

__all__ = ["extend_attention", "run", "verify_call"]
