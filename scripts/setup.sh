#!/usr/bin/env bash
# Install zeroshard and what its tests need (transformers, accelerate, lightning, ...) at the exact versions the
# suite last passed with (constraints.txt, written by scripts/freeze_constraints.py). With --latest: the newest
# versions the extras allow instead, torch still held at the local CPU wheel (without a pin, installing lightning
# or accelerate upgrades torch and pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [[ "${1:-}" == "--latest" ]]; then
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==2.13.0" > "$constraints"
    python3 -m pip install -q --disable-pip-version-check -U --upgrade-strategy eager -c "$constraints" -e ".[test,docs]"
else
    python3 -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,docs]"
fi
# ms-swift's elastic restart is tested with its own source (tests/distributed/scripts/compat/ms_swift_elastic.py
# compiles four functions from the installed file); its dependencies (modelscope, ...) are not needed for them
if [[ "${1:-}" == "--latest" ]]; then
    python3 -m pip install -q --disable-pip-version-check --no-deps -U ms-swift
else
    python3 -m pip install -q --disable-pip-version-check --no-deps "ms-swift==4.6.0"
fi
