#!/usr/bin/env bash
# Build the documentation site into site/ with warnings as errors (broken links or references fail), after
# regenerating the generated reference pages (the config keys from the schema, the command line from its parsers).
# `bash scripts/docs.sh serve` previews it at http://127.0.0.1:8000 instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, printed on every build
python3 scripts/docs_reference.py docs/reference
if [[ "${1:-}" == "serve" ]]; then
    exec python3 -m mkdocs serve
fi
exec python3 -m mkdocs build --strict --quiet
