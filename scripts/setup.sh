#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install the project with its test tools.
# Idempotent: re-running after a change of pyproject.toml reinstalls, otherwise it is instant.
# Usage: source scripts/setup.sh   (sets $PY)   or   bash scripts/setup.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON_BIN:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    echo "[setup] installing dependencies (first run takes a few minutes)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # Pinned first and on its own: an unpinned torch would pull a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
PY="$VENV/bin/python"
export PY
