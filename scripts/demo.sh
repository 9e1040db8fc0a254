#!/usr/bin/env bash
# Sets everything up and runs the main job: a 2-worker DDP fit on CPU with live progress.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh tutorials
exec .venv/bin/python -m ddp_notebook demo "$@"
