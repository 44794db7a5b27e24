#!/usr/bin/env bash
# Set up, then run the whole service: Redis, the API on :8000 and one worker. Flags: see --help.
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
exec .venv/bin/python serve.py "$@"
