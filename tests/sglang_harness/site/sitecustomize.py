"""On PYTHONPATH, this runs in every Python process started with it, SGLang's spawned scheduler and detokenizer
too: where the real sgl_kernel is absent, it installs kdtree's stand-in (`tests/sglang_harness`), so a real
server runs on a machine whose torch no sglang-kernel build loads under. Pair it with
SGLANG_FORCE_FUSED_OP_BACKEND=torch (norms and activations take their torch paths) and
SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 (the stand-in has no distribution version)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, where sglang_harness lives
import sglang_harness  # noqa: E402

sglang_harness.install_sgl_kernel_shim()
