#!/usr/bin/env bash
# Sets everything up and opens JupyterLab on the tutorials (loopback only; the URL with its
# token is printed). Extra arguments go to jupyter lab, e.g. --port 8899.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh tutorials
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)  # Jupyter refuses root unless told
exec .venv/bin/jupyter lab --ip=127.0.0.1 --no-browser "${extra[@]}" notebooks/01_quickstart.ipynb "$@"
