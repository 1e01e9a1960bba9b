#!/usr/bin/env bash
# Set up (once) and run the whole test suite, after the lint gate. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# --durations: every run (CI included) says where the suite's time goes.
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=25 "$@"
