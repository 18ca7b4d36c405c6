"""Write the shipped SGLang captures (data/captured_batches/sglang-*.safetensors) with the kdtree backend's capture
mode, from SGLang's own backend path: the attention test kit's runner (real ForwardBatch, ReqToTokenPool,
MLATokenToKVPool, EagleVerifyInput custom mask; Triton's output as the reference), 576/512 bf16, Kimi K2's scale.

Usage (GPU, SGLang importable, tests/ on PYTHONPATH for the sgl_kernel stand-in; `tools/gpu_session.sh
sglang-captures`): python3 tools/sglang_captures.py OUT_DIR
"""

import os
import sys
from pathlib import Path

import numpy as np

from sglang_harness import install_sgl_kernel_shim  # noqa: E402

install_sgl_kernel_shim()
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()
from kdtree import load  # noqa: E402
from kdtree.sglang import kit  # noqa: E402
from kdtree.trees import chain, make_tree  # noqa: E402

KIMI_SCALING = 0.130861
out = Path(sys.argv[1])
rng = np.random.default_rng(14)
CAPTURES = {  # name: (prefix lengths, trees, heads)
    "sglang-ddtree17": ((0, 1, 300, 1500), [make_tree("ddtree", 17, rng) for _ in range(4)], 8),
    "sglang-chain16": ((120, 1800), [chain(16), chain(16)], 8),
}
for name, (prefixes, parents, heads) in CAPTURES.items():
    where = out / f"{name}.tmp"
    os.environ.update(KDTREE_MODE="capture", KDTREE_CAPTURE_DIR=str(where), KDTREE_CAPTURE_MAX_FILES="1")
    case = kit.verify_case(name, "kdtree", prefixes, len(parents[0]), heads)
    kit.run_verify(case, parents, scaling=KIMI_SCALING)
    (written,) = where.glob("*.safetensors")
    final = out / f"{name}.safetensors"
    written.rename(final)
    where.rmdir()
    print(load(final))
