#!/usr/bin/env bash
# SGLang for an offline GPU machine (cp312, no network there) as one xz archive, .whl/site312.tar.xz (~17 MB; the wheels
# are ~50 MB, SGLang's 39 of them): SGLang's cp312 wheel and the pure-Python and cp312 packages its import chain
# needs beyond what the device has (torch, triton, numpy, ...), installed with `pip install --target` for Python
# 3.12, less the server's Rust extensions (kept: the radix cache's), multimodal generation and the benchmarks,
# which nothing kdtree runs imports; plus what SGLang's HTTP server imports unconditionally (xgrammar, soundfile,
# jsonschema and theirs), so `kdtree server-check` can launch a real server. Versions pinned to those the archive was built and run with (H200, SGLang
# 0.5.23). `tools/gpu_session.sh` unpacks it into /tmp/site when carried (`carry: [".whl"]`).
# Usage (this machine, repository root, network): bash tools/pack_sglang.sh [VERSION]
set -euo pipefail
VERSION=${1:-0.5.23}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp312=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=("sglang==$VERSION" orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4
      pydantic_core==2.50.5 typing_inspection==0.4.5 annotated_types==0.8.0 pyzmq==27.3.0 ipython==9.18.1
      decorator==5.3.1 ipython_pygments_lexers==1.1.1 matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0
      prompt_toolkit==3.0.53 wcwidth==0.9.4 pygments==2.21.0 stack_data==0.6.3 asttokens==3.0.2 executing==2.3.0
      pure_eval==0.2.4 traitlets==5.16.1 dill==0.4.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru==0.7.3
      gguf==0.19.0 openai==2.8.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 partial_json_parser==0.2.1.1.post7
      truststore==0.10.5 python-multipart==0.0.34 httpx2==2.16.2 httpcore2==2.16.2 uvicorn==0.54.0 fastapi==0.165.0
      setproctitle==1.3.8 opentelemetry-api==1.45.2 importlib-metadata==10.2.0 zipp==4.1.2
      xgrammar==0.2.7 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 jsonschema==4.26.0
      jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)
pip download -q --no-deps "${cp312[@]}" -d "$work/wheels" "${pkgs[@]}"
pip install -q --no-index --no-deps --no-compile "${cp312[@]}" --target "$work/site" "$work"/wheels/*.whl
rm -f "$work"/site/sglang/srt/rust_extensions/_{server,bench,grpc,multimodal}.*.so
rm -rf "$work/site/sglang/multimodal_gen" "$work/site/sglang/benchmark" "$work/site/bin"
find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p .whl
(cd "$work/site" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.whl/site312.tar.xz")
ls -l .whl/site312.tar.xz
