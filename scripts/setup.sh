#!/usr/bin/env bash
# Create .venv, install rhymerl (editable, with dev extras), fetch the default model, build the CPU kernels.
# Idempotent and cached: re-running only re-installs when pyproject.toml changed.
# May be sourced (run.sh, test.sh do); leaves the caller in the repo root.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMP="$VENV/.rhymerl-installed"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi

want="$("$VENV/bin/python" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]; then
  # torch first and pinned, so the local CPU wheel is used instead of pip pulling a CUDA build.
  echo "[setup] installing torch==2.13.0"
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  echo "[setup] installing rhymerl[dev,bench] (editable)"
  "$VENV/bin/python" -m pip install -q -e ".[dev,bench]"
  echo "$want" > "$STAMP"
else
  echo "[setup] python packages up to date"
fi

echo "[setup] model smollm2-135m: $("$VENV/bin/python" -m rhymerl.model.fetch smollm2-135m)"
# The fused CPU kernels: built once here so that the first run does not pause for it; without a C++
# compiler this warns and rhymerl runs the eager forward.
echo "[setup] fused CPU kernels: $("$VENV/bin/python" -c 'from rhymerl.engine.backends import native; print("ready" if native.ops() else "unavailable, eager forward")')"
