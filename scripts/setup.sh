#!/usr/bin/env bash
# Set up .venv for diloco: the pinned CPU build of torch first, then diloco with its test tools.
# Idempotent: does nothing when .venv is already set up for this pyproject.toml.
#   TORCH_SPEC="torch==2.13.0" (default) | "skip" (keep the torch you installed, e.g. a CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.diloco-setup
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch before the project: the project's own requirement is a range (bring your own CUDA build),
# and a bare range in a fresh venv would pull a multi-GB CUDA build.
if [ "$TORCH_SPEC" != "skip" ]; then
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
