#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1 PATH="$PATH:/usr/local/cuda/bin"
H="tree of $(cat .tree-commit 2>/dev/null), branch wip/sweeps"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS
  { echo "# $* ($H)"; timeout "$limit" "$@"; } > "$OUT/$name.log" 2>&1; local rc=$?; tail -n 40 "$OUT/$name.log"; echo "== $name rc=$rc ($((SECONDS - t0)) s)"; return $rc; }
step sweeps-test 240 python3 -m pytest -q -x tests/test_kernel_gpu.py -k swept
step sweeps-variants 240 env OUT="$OUT" python3 scripts/variants.py --cases "kimi-tp8 ddtree64 8k x8" mixed "dsv3-tp8 ddtree64 8k x8" 128k "32k x4" --variants wgmma_seesaw64 wgmma_seesaw64_sweeps1 wgmma_seesaw64_sweeps2 wgmma_seesaw64_sweeps3 wgmma wgmma_sweeps2 bm32_regs bm32_sweeps2 --repeat 2
