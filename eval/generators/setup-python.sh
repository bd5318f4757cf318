#!/usr/bin/env bash
# Creates eval/.venv with the reference tools (PyTorch, transformers, gguf, ModelOpt,
# compressed-tensors) pinned in eval/generators/requirements.txt. Prints the venv's path.
# Development only: the evaluator never imports Python. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$(cd "$here/.." && pwd)/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -r "$here/requirements.txt"
echo "$venv"
