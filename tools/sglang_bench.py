"""`kdtree bench --sglang` on a machine where SGLang imports but sgl_kernel does not (an offline GPU machine): the test
harness's sgl_kernel stand-in (tests/sglang_harness, on PYTHONPATH:
tools/gpu_session.sh puts it there), then the benchmark. Usage: python3 tools/sglang_bench.py OUT.json [CASE ...]"""

import sys

from sglang_harness import install_sgl_kernel_shim  # noqa: E402

install_sgl_kernel_shim()
from kdtree.sglang.plugin import register  # noqa: E402

register()  # what SGLang's plugin loader does with the installed entry point
from kdtree.sglang import bench  # noqa: E402

cases = [c for c in bench.SERVING_CASES if not sys.argv[2:] or any(p in c.name for p in sys.argv[2:])]
result = bench.run(cases)
bench.save(result, sys.argv[1])
print(f"wrote {sys.argv[1]}")
