#!/usr/bin/env bash
# FlashInfer for an offline GPU machine (cp312, no network there) as one xz archive, .whl/fi312.tar.xz (~15 MB; the wheel is
# 62 MB and unpacks to 426 MB): its Python files, the headers and the MLA sources its JIT compiles
# (data/include, cutlass, cccl, spdlog, csrc/batch_mla*), the pure-Python packages its import needs, and
# apache-tvm-ffi for cp312 (taken from .whl/site312.tar.xz, which has SGLang's copy). With the repository that is
# under a device call's 64 MiB; SGLang's archive does not fit beside it. Used by `tools/gpu_session.sh bench-chain`.
# Usage (this machine, repository root): bash tools/pack_flashinfer.sh [VERSION]
set -euo pipefail
VERSION=${1:-0.7.2.post1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download -q --no-deps --python-version 3.12 --only-binary=:all: "flashinfer-python==$VERSION" -d "$work/wheel"
pip install -q --no-deps --target "$work/deps" einops tabulate tqdm click nvidia-ml-py packaging requests ninja
mkdir -p "$work/x" "$work/out"
(cd "$work/x" && unzip -q "$work"/wheel/*.whl)
(cd "$work/x" && {
  find flashinfer \( -name "*.py" -o -name "*.jinja" -o -name "*.json" \) -not -path "flashinfer/data/csrc/*"
  find flashinfer/data/include flashinfer/data/cutlass flashinfer/data/spdlog flashinfer/data/cccl -type f
  find flashinfer/data/csrc -maxdepth 1 -type f \( -name "batch_mla*" -o -name "*.h" -o -name "*.cuh" \)
  ls -d flashinfer_python-*.dist-info
} > "$work/files" && tar -cf - -T "$work/files" | tar -xf - -C "$work/out")
cp -r "$work"/deps/* "$work/out/"
tar -xJf .whl/site312.tar.xz -C "$work/out" ./tvm_ffi ./apache_tvm_ffi-0.1.11.dist-info
find "$work/out" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p .whl
(cd "$work/out" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.whl/fi312.tar.xz")
ls -l .whl/fi312.tar.xz
