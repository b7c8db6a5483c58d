#!/usr/bin/env bash
# Install zeroshard and what its tests need (transformers, accelerate, lightning). torch is held at the local CPU
# wheel by a constraints file: without it, installing lightning or accelerate upgrades torch and pulls CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
python3 -m pip install -q --disable-pip-version-check -c "$constraints" -e ".[test]"
