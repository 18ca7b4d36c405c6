#!/usr/bin/env bash
# A real sgl_kernel for an offline GPU machine (torch 2.11, sm_90, no network there) as one xz archive,
# .whl/sgl_kernel312.tar.xz (~13 MB; sglang-kernel's wheels are ~375 MB each): sglang-kernel 0.4.10's Python files
# and dist-info (the version SGLang 0.5.23 asks for) with 0.4.5's sm90/common_ops.abi3.so (0.4.5 was built for
# torch 2.11; 0.4.10's own library needs symbols torch 2.11 lacks; the ops both versions have share their
# schemas). Left out: flash_ops, flashmla_ops, infllm_ops and sm100/, which no path kdtree's server check takes.
# Unpacked beside SGLang (`tar -xJf .whl/sgl_kernel312.tar.xz -C /tmp/site`), it replaces the test stand-in
# (tests/sglang_harness) and SGLANG_FORCE_FUSED_OP_BACKEND=torch.
# Usage (this machine, repository root, network): bash tools/pack_sgl_kernel.sh
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp312=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
pip download -q --no-deps "${cp312[@]}" -d "$work/new" sglang-kernel==0.4.10
pip download -q --no-deps "${cp312[@]}" -d "$work/old" sglang-kernel==0.4.5
mkdir -p "$work/site/sgl_kernel/sm90"
(cd "$work/site" && unzip -q "$work"/new/*.whl -x '*.so')
unzip -q -j "$work"/old/*.whl 'sgl_kernel/sm90/common_ops.abi3.so' -d "$work/site/sgl_kernel/sm90"
mkdir -p .whl
(cd "$work/site" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.whl/sgl_kernel312.tar.xz")
ls -l .whl/sgl_kernel312.tar.xz
