#!/usr/bin/env bash
# Install zeroshard and what its tests need. torch is pinned to the local CPU wheel; an unpinned
# torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
