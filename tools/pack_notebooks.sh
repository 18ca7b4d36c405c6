#!/usr/bin/env bash
# The notebook stack for an offline GPU machine (cp312, no network there) as one xz archive, .whl/nbsite312.tar.xz: jupytext,
# nbclient, nbformat, ipykernel and ipywidgets with what they import, installed with `pip install --target` for
# Python 3.12, less what the device image already has (matplotlib and its dependencies, fontTools among them,
# numpy, pygments, pyyaml, psutil, attrs, markdown-it-py: /work/.library/device/KINDS.md lists them; packed, they
# would shadow the device's versions) and what a headless run does not import (debugpy, jedi; the JupyterLab
# extensions' files). Versions pinned to those the archive was built and run with. `tools/gpu_session.sh
# notebooks` unpacks it into /tmp/site when carried (carry it alone: with the SGLang archive and the captures a call
# is over its 64 MiB).
# Usage (this machine, repository root, network): bash tools/pack_notebooks.sh
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp312=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(jupytext==1.19.6 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 ipywidgets==8.1.9 asttokens==3.0.2
      comm==0.2.3 executing==2.3.0 fastjsonschema==2.22.3 ipython==9.18.1 ipython_pygments_lexers==1.1.1
      jsonschema==4.26.0 jsonschema_specifications==2025.9.1 jupyter_client==8.10.0 jupyter_core==5.9.1
      jupyterlab_widgets==3.0.17 matplotlib_inline==0.2.2 mdit_py_plugins==0.7.0 nest_asyncio2==1.7.4 pexpect==4.9.0
      platformdirs==4.14.9 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 pyzmq==27.3.0
      referencing==0.37.0 rpds_py==2026.9.1 stack_data==0.6.3 tornado==6.6.1 traitlets==5.16.1 wcwidth==0.9.4
      widgetsnbextension==4.0.16)
pip download -q --no-deps "${cp312[@]}" -d "$work/wheels" "${pkgs[@]}"
pip install -q --no-index --no-deps --no-compile "${cp312[@]}" --target "$work/site" "$work"/wheels/*.whl
(cd "$work/site" && rm -rf bin share/jupyter/labextensions share/jupyter/nbextensions widgetsnbextension/static \
   && find . -name __pycache__ -type d -prune -exec rm -rf {} +)
mkdir -p .whl
(cd "$work/site" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.whl/nbsite312.tar.xz")
ls -l .whl/nbsite312.tar.xz
