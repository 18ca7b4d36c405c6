#!/usr/bin/env bash
# Writes the tested set of each build, requirements/BUILD.txt: every package pinned, as pip resolves today the
# build's torch (requirements/BUILD.in) with kdtree's extras for it, installed into a fresh environment and frozen.
# `make` installs that file, so the two commands install the same versions on any day. Run it to move the set
# forward (say after raising torch in a .in file), then `make clean test` on it and commit both.
# Usage (repository root, network): requirements/lock.sh [BUILD ...]   (default: cpu cuda13; `make lock` runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A EXTRAS=([cpu]=lab,dev,nvrtc [cuda13]=lab,dev,nvrtc,cuda13 [cuda12]=lab,dev,cuda12)
builds=("$@"); [ ${#builds[@]} -gt 0 ] || builds=(cpu cuda13)
for build in "${builds[@]}"; do
  [ -n "${EXTRAS[$build]:-}" ] || { echo "lock.sh: no build named '$build' (cpu, cuda13, cuda12)" >&2; exit 2; }
  venv=$(mktemp -d)
  python3 -m venv "$venv"
  echo "lock.sh: resolving the $build build in $venv"
  # the build's torch from its index alone (pip asks every index for every package: an index that does not answer
  # here would be asked ~150 times), then kdtree's extras, which keep that torch
  "$venv/bin/python" -m pip install -q --no-deps -r "requirements/$build.in"
  "$venv/bin/python" -m pip install -q -e ".[${EXTRAS[$build]}]"
  {
    echo "# The $build build's tested set: written by requirements/lock.sh from requirements/$build.in and"
    echo "# kdtree's extras ${EXTRAS[$build]} on $(date -u +%Y-%m-%d) (Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'))."
    echo "# Edit the .in file, not this one. make installs the .in's torch first (from its index), then this file,"
    echo "# then kdtree itself (pip install --no-deps -e .)."
    "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -E '^(pip|kdtree)=='
  } > "requirements/$build.txt.tmp"
  mv "requirements/$build.txt.tmp" "requirements/$build.txt"
  rm -rf "$venv"
  echo "lock.sh: requirements/$build.txt ($(grep -vc '^[#-]' "requirements/$build.txt") packages)"
done
