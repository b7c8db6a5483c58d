#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (unit tests and multi-process Gloo tests on CPU), printing the
# 25 slowest tests. With --quick: the unit tests and one 2-rank spawn training stages 0-3 (the inner loop).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check zeroshard tests benchmarks examples
if [[ "${1:-}" == "--quick" ]]; then
    shift
    exec python3 -m pytest -q --durations=25 tests/unit tests/distributed/test_smoke.py "$@"
fi
exec python3 -m pytest -q --durations=25 tests "$@"
