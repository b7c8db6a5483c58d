#!/usr/bin/env bash
# Build the documentation site into site/ with warnings as errors (broken links or references fail), after checking
# that the generated reference pages (the config keys from the schema, the command line from its parsers) are
# current; `python3 scripts/docs_reference.py docs/reference` regenerates them.
# `bash scripts/docs.sh serve` previews it at http://127.0.0.1:8000 instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, printed on every build
if ! python3 -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
    # the docs extra at the pinned versions, torch held (scripts/setup.sh installs it with the test extra)
    python3 -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[docs]"
fi
python3 scripts/docs_reference.py --check docs/reference
if [[ "${1:-}" == "serve" ]]; then
    exec python3 -m mkdocs serve
fi
exec python3 -m mkdocs build --strict --quiet
