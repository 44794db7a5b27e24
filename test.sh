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
# tests/test_sentinel.py runs a primary, a replica and three redis-sentinel processes of its own
# (Debian's redis-sentinel: redis-server in sentinel mode; its service is not started in a container).
if ! command -v redis-sentinel >/dev/null; then
    echo "installing redis-sentinel..."
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-sentinel >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq redis-sentinel >/dev/null; fi
fi
# tests/test_cluster.py joins three redis-servers into a cluster with redis-cli (Debian's redis-tools,
# which redis-server's package brings along).
if ! command -v redis-cli >/dev/null; then
    echo "installing redis-tools..."
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-tools >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq redis-tools >/dev/null; fi
fi
# tests/test_deploy.py validates docker-compose.yml with Debian's docker-compose (1.29): its
# `config` needs no Docker engine (these machines have none, so no image is built in the tests).
# Without its recommended docker.io: the engine is not wanted here.
if ! command -v docker-compose >/dev/null; then
    echo "installing docker-compose..."
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; fi
fi
# tests/test_metrics_processes.py runs a real Prometheus (Debian's, 2.42) against the API and the workers.
# Without its recommends (node exporter and the like): only the server is wanted.
if ! command -v prometheus >/dev/null; then
    echo "installing prometheus..."
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; fi
fi
exec .venv/bin/python -m pytest "$@"
