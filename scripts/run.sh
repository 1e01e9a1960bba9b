#!/usr/bin/env bash
# Set up (once) and run the embedded default job: `diloco run` with any extra arguments given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/diloco run "$@"
