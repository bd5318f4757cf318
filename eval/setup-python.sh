#!/usr/bin/env bash
# Creates eval/.venv with the reference tools (PyTorch, transformers, gguf).
# Development only: the evaluator never imports Python. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -r "$here/requirements.txt"
echo "$venv"
