#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (unit tests and multi-process Gloo tests on CPU), printing the
# 25 slowest tests. Options, before pytest's own arguments:
#   --latest  test the newest package versions the extras allow instead of the pinned ones (constraints.txt)
#   --quick   the unit tests and one 2-rank spawn training stages 0-3 (the inner loop)
#   --stress  only the long loops the default run leaves out (pytest's stress marker)
set -euo pipefail
cd "$(dirname "$0")/.."
setup=() quick=0 stress=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --latest) setup=(--latest); shift ;;
        --quick) quick=1; shift ;;
        --stress) stress=1; shift ;;
        *) break ;;
    esac
done
bash scripts/setup.sh "${setup[@]}"
python3 -m ruff check zeroshard tests benchmarks examples
bash scripts/docs.sh  # the documentation site, warnings as errors
if [[ $stress == 1 ]]; then
    exec python3 -m pytest -q --durations=25 -m stress tests "$@"
fi
if [[ $quick == 1 ]]; then
    exec python3 -m pytest -q --durations=25 tests/unit tests/distributed/test_smoke.py "$@"
fi
exec python3 -m pytest -q --durations=25 tests "$@"
