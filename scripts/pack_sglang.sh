#!/usr/bin/env bash
# SGLang for the lent H200 (cp312, no network there) as one xz archive, .whl/site312.tar.xz (~17 MB; the wheels
# are ~50 MB): SGLang's cp312 wheel and the pure-Python and cp312 packages its import chain needs beyond what the
# device has (torch, triton, numpy, ...), installed with `pip install --target` for Python 3.12, less the server's
# Rust extensions (kept: the radix cache's), multimodal generation and the benchmarks, which nothing kdtree runs
# imports. `scripts/gpu_session.sh` unpacks it into /tmp/site when carried (`carry: [".whl"]`).
# Usage (this machine, repository root, network): bash scripts/pack_sglang.sh [VERSION]
set -euo pipefail
VERSION=${1:-0.5.23}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp312=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=("sglang==$VERSION" orjson pybase64 starlette msgspec pydantic==2.14.4 pydantic_core==2.50.5 typing_inspection
      annotated_types pyzmq "ipython>=9,<10" decorator ipython_pygments_lexers matplotlib-inline pexpect ptyprocess
      prompt_toolkit wcwidth pygments stack_data asttokens executing pure_eval traitlets dill apache-tvm-ffi==0.1.11
      compressed-tensors==0.18.0 loguru gguf openai==2.8.0 jiter distro sniffio partial_json_parser truststore
      python-multipart httpx2 httpcore2 uvicorn fastapi setproctitle opentelemetry-api importlib-metadata zipp)
pip download -q --no-deps "${cp312[@]}" -d "$work/wheels" "${pkgs[@]}"
pip install -q --no-index --no-deps --no-compile "${cp312[@]}" --target "$work/site" "$work"/wheels/*.whl
rm -f "$work"/site/sglang/srt/rust_extensions/_{server,bench,grpc,multimodal}.*.so
rm -rf "$work/site/sglang/multimodal_gen" "$work/site/sglang/benchmark" "$work/site/bin"
find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p .whl
(cd "$work/site" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.whl/site312.tar.xz")
ls -l .whl/site312.tar.xz
