#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (unit tests and multi-process Gloo tests on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check zeroshard tests benchmarks examples
exec python3 -m pytest -q tests "$@"
