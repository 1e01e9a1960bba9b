#!/usr/bin/env bash
# Set up (once) and run the whole test suite, after the lint gate. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# Workers: one per core, and three on a 2-core machine: the multi-process tests spend much of
# their time waiting on timers (a partition held 60 s, learners resting between steps), so a
# third worker fills cores two leave idle (on 2 cores: 10m03s and 10m13s against 12m28s with two,
# the same hour). --durations: every run (CI included) says where the suite's time goes.
cores=$(nproc)
exec .venv/bin/python -m pytest -q -n $((cores > 2 ? cores : 3)) --dist worksteal --durations=25 "$@"
