#!/usr/bin/env bash
# Create .venv and install the requirements when they are missing or have changed.
# Usage: source scripts/setup_env.sh [dev]   (sourced by scripts/demo.sh and scripts/test.sh)
# Needs only Python >= 3.10 (3.11 recommended) on PATH; nothing is compiled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON_BIN="${PYTHON:-$(command -v python3.11 || command -v python3)}"
REQ="$ROOT/requirements.txt"
[ "${1:-}" = "dev" ] && REQ="$ROOT/requirements-dev.txt"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
    echo "setup: creating $ROOT/.venv with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv "$ROOT/.venv"
fi
STAMP="$ROOT/.venv/.installed-$(cat "$ROOT/requirements.txt" "$REQ" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    echo "setup: installing $(basename "$REQ") into .venv"
    "$ROOT/.venv/bin/python" -m pip install --quiet --upgrade pip
    "$ROOT/.venv/bin/python" -m pip install --quiet -r "$REQ"
    touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
cd "$ROOT"
