#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh: .venv with the docs tools) and builds the documentation
# site into docs/_build/html, warnings as errors and nitpicky on the package's own names, as the
# test suite builds it. Offline: nothing is fetched at build time. Extra arguments go to
# sphinx-build (e.g. -E to rebuild every page).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "docs: building docs/_build/html (sphinx-build -W --keep-going -n)" >&2
.venv/bin/python -m sphinx -W --keep-going -n -q "$@" docs docs/_build/html
echo "docs: built; open file://$PWD/docs/_build/html/index.html" >&2
