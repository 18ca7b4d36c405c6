#!/usr/bin/env bash
# Regenerates the shipped synthetic captures byte for byte (kdtree synth is deterministic per seed).
# The sglang-*.safetensors captures come from SGLang itself: tools/sglang_captures.py on a GPU (README.md).
# Usage: data/captured_batches/regenerate.sh [kdtree command]   (default: kdtree on PATH)
set -euo pipefail
cd "$(dirname "$0")"
K=${1:-kdtree}
$K synth --force -o ddtree64-bs3.safetensors --budget 64 --batch 3 --prefix 1024,1500,1200 --seed 2
$K synth --force -o ddtree256.safetensors --budget 256 --batch 1 --prefix 400 --seed 3
$K synth --force -o mixed-prefix.safetensors --budget 32 --batch 5 --prefix 0,1,37,500,800 --seed 4
$K synth --force -o kimi-dp-h64.safetensors --preset kimi-k2-dp --budget 12 --batch 2 --prefix 300,500 --seed 6
$K synth --force -o dsv3-3layers.safetensors --preset deepseek-v3-tp8 --budget 16 --batch 2 --prefix 200,360 \
  --layers 3,30,58 --seed 7
$K synth --force -o extreme-logits.safetensors --budget 32 --batch 2 --prefix 300,800 --extreme-logits --seed 8
