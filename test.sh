#!/usr/bin/env bash
# Set up, then run every test (the slow ones too). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
# The integration tests start private redis-servers of their own.
if ! command -v redis-server >/dev/null; then
    echo "installing redis-server..."
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi
fi
exec .venv/bin/python -m pytest "$@"
