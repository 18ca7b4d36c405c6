#!/usr/bin/env bash
# kdtree as a server image installs it: the wheel built from this checkout's committed tree, installed with the cpu build's pins
# (requirements/cpu.txt as constraints) and the nvrtc extra into a fresh environment, then used from a folder
# outside any checkout: the kernels compile for sm_120 and sm_90 from the wheel's own sources, the self-check
# passes (no GPU: the kernel's torch model), and SGLang's plugin entry point loads. CI runs it (.ci/run).
# Usage (repository root): tools/wheel_check.sh [BUILD]   (BUILD: whose pins; default cpu)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-cpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q --no-hardlinks "$root" "$work/src"  # the committed tree: no build/ of an earlier layout in the wheel
python3 -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/kdtree-*.whl)
echo "wheel_check: $(basename "$wheel"): $(python3 -m zipfile -l "$wheel" | grep -c 'kdtree/kernels/.*\.cu') kernel sources"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps -r "$root/requirements/$build.in"  # the build's torch, as make does
"$work/venv/bin/python" -m pip install -q -c "$root/requirements/$build.txt" "$wheel[nvrtc]"
mkdir "$work/elsewhere" && cd "$work/elsewhere"
export KDTREE_CACHE_DIR="$work/cache"  # a self-check of its own, not a verdict cached by an earlier run
"$work/venv/bin/python" -c "import kdtree.kernel.config as c; assert str(c.KERNEL_DIR).startswith('$work/venv/'), c.KERNEL_DIR; print('wheel_check: kernel sources at', c.KERNEL_DIR)"
"$work/venv/bin/kdtree" compile --arch sm_120 --arch sm_90
"$work/venv/bin/kdtree" selfcheck
"$work/venv/bin/python" - <<'PY'
from importlib.metadata import entry_points

(ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kdtree"]
register = ep.load()
print(f"wheel_check: SGLang plugin entry point {ep.name} = {ep.value} loads ({register.__module__}.{register.__name__})")
PY
echo "wheel_check: passed"
