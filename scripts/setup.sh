#!/usr/bin/env bash
# Set up .venv for diloco: the pinned CPU build of torch first, then diloco with its test tools.
# Idempotent: does nothing when .venv is already set up for this pyproject.toml.
#   TORCH_SPEC="torch==2.13.0" (default) | "skip" (keep the torch you installed, e.g. a CUDA build)
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu (default) | "" (PyPI's build alone)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
stamp=.venv/.diloco-setup
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch before the project: the project's own requirement is a range (bring your own CUDA build),
# and a bare range in a fresh venv would pull a multi-GB CUDA build.
# PyPI's Linux wheel is that CUDA build; PyTorch's CPU index has the +cpu one, which pip prefers
# (a local version label sorts above the bare version). An index this machine cannot reach (a
# mirror-only network) is left out, and pip takes what its own configuration offers.
if [ "$TORCH_SPEC" != "skip" ]; then
  index=()
  if [ -n "$TORCH_INDEX" ] && .venv/bin/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$TORCH_INDEX/" 2>/dev/null; then
    index=(--extra-index-url "$TORCH_INDEX")
  fi
  .venv/bin/python -m pip install -q "${index[@]}" "$TORCH_SPEC"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
