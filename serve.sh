#!/usr/bin/env bash
# Set up, then run the whole service: Redis, the API on :8000 and one worker. Flags: see --help.
set -euo pipefail
cd "$(dirname "$0")"
# Before setup.sh makes the venv with it: the Python it will use (the same choice as setup.sh's).
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3 || true)}
if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "serve.sh: Storyteller needs Python >= 3.11 (found: ${PYTHON:-none}${PYTHON:+ $("$PYTHON" -V 2>&1)}): install python3.11, or set PYTHON=/path/to/python3.11" >&2
    exit 2
fi
if [ ! -x .venv/bin/python ] && ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
    echo "serve.sh: $PYTHON cannot make a venv (no ensurepip): on Debian/Ubuntu, apt-get install python3.11-venv" >&2
    exit 2
fi
export PYTHON
./setup.sh
exec .venv/bin/python serve.py "$@"
