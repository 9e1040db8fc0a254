#!/usr/bin/env bash
# Creates .venv and installs ddp_notebook with its test tools. Safe to run again: when .venv
# already holds what pyproject.toml asks for, it says so and returns in a second.
# torch is pinned to 2.13.0: the CPU build this project is developed and tested with
# (an unpinned torch would download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0
say() { echo "setup: $*" >&2; }
# What the installed environment was made from: a change to any of these reinstalls.
stamp_now=$( (cat pyproject.toml; echo "$TORCH"; "$PYTHON" --version) | sha256sum | cut -c1-16)
stamp_file=.venv/.ddp_notebook-setup
if [ -x .venv/bin/python ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_now" ] \
   && .venv/bin/python -c "import ddp_notebook, torch, sphinx" 2>/dev/null; then
    say ".venv is up to date (delete .venv/.ddp_notebook-setup to reinstall)"
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
say "installing $TORCH (CPU build; about 200 MB the first time)"
quiet .venv/bin/pip install -q --disable-pip-version-check "$TORCH"
say "installing ddp_notebook and its notebook, test and docs tools (JupyterLab, ipywidgets, ipyparallel, pytest, Sphinx)"
quiet .venv/bin/pip install -q --disable-pip-version-check -e ".[test,docs]"
echo "$stamp_now" > "$stamp_file"
say "done: .venv/bin/python has ddp_notebook"
