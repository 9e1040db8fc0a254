#!/usr/bin/env bash
# Creates .venv and installs ddp_notebook with what a command needs: `setup.sh tutorials` (what
# ./scripts/lab.sh and the tutorials use: JupyterLab, ipyparallel, the frameworks, the trackers),
# `setup.sh all` (the default: that, the test tools and the docs tools). Safe to run again: when
# .venv already holds what pyproject.toml asks for, it says so and returns in a second.
# torch is pinned to 2.13.0, the version this project is developed and tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=torch==2.13.0
WHAT=${1:-all}
case "$WHAT" in
    tutorials) extras="tutorials"; check="import ddp_notebook, torch, jupyterlab" ;;
    all) extras="test,docs"; check="import ddp_notebook, torch, jupyterlab, sphinx, pytest" ;;
    *) echo "setup: say 'tutorials' or 'all', not '$WHAT'" >&2; exit 2 ;;
esac
say() { echo "setup: $*" >&2; }
# What the installed environment was made from: a change to any of these reinstalls.
stamp_now=$( (cat pyproject.toml; echo "$TORCH"; "$PYTHON" --version) | sha256sum | cut -c1-16)
stamp_file=.venv/.ddp_notebook-setup
# The stamp says what was installed: "all" holds what "tutorials" needs.
if [ -x .venv/bin/python ] && [ -f "$stamp_file" ] && .venv/bin/python -c "$check" 2>/dev/null \
   && { [ "$(cat "$stamp_file")" = "$stamp_now all" ] || [ "$(cat "$stamp_file")" = "$stamp_now $WHAT" ]; }; then
    say ".venv is up to date (delete .venv/.ddp_notebook-setup to reinstall)"
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
# No download cache: a CI machine's disk may be nearly full, and nothing here is installed twice.
pip_install() { .venv/bin/pip install -q --no-cache-dir --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# The build pip finds first: PyPI's is a CUDA build of a few GB on Linux x86_64; PyTorch's CPU
# index (PIP_INDEX_URL=https://download.pytorch.org/whl/cpu) or a local wheel, a CPU build of ~200 MB.
say "installing $TORCH: the build pip finds first (PyPI: a CUDA build of a few GB on Linux; PyTorch's CPU index" \
    "or a local wheel: a CPU build of about 200 MB)"
pip_install "$TORCH"
say "torch $(.venv/bin/python -c 'import torch; print(torch.__version__, "(a CUDA build)" if torch.version.cuda else "(a CPU build)")')"
if [ "$WHAT" = tutorials ]; then
    say "installing ddp_notebook and what the tutorials use (JupyterLab, ipyparallel, Lightning, transformers," \
        "accelerate, pandas, TensorBoard, MLflow, Optuna, scikit-learn)"
else
    say "installing ddp_notebook, what the tutorials use, and the test and docs tools (pytest, Playwright, Sphinx...)"
fi
pip_install -e ".[$extras]"
echo "$stamp_now $WHAT" > "$stamp_file"
say "done: .venv/bin/python has ddp_notebook"
