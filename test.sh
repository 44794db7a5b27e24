#!/usr/bin/env bash
# Set up, then run every test (the slow ones too). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh

# Debian's packages the tests need, each installed when its command is missing (one apt-get update).
updated=0
need() {  # need COMMAND PACKAGE: why, in the comment above each call
    command -v "$1" >/dev/null && return
    echo "installing $2..."
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    if [ "$updated" = 0 ]; then $sudo apt-get update -qq; updated=1; fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
}
# The integration tests start private redis-servers of their own.
need redis-server redis-server
# tests/test_sentinel.py runs a primary, a replica and three redis-sentinel processes of its own
# (Debian's redis-sentinel: redis-server in sentinel mode; its service is not started in a container).
need redis-sentinel redis-sentinel
# tests/test_cluster.py joins three redis-servers into a cluster with redis-cli.
need redis-cli redis-tools
# tests/test_metrics_processes.py runs a real Prometheus (Debian's, 2.42) against the API and the
# workers; tests/test_deploy.py checks the alert rules with its promtool.
need prometheus prometheus
# tests/test_deploy.py validates docker-compose.yml with Debian's docker-compose (1.29);
# tests/test_docker.py builds both images with Debian's Docker engine (20.10; its daemon is started by
# the test, with a data root of its own), their base made of Debian's packages by mmdebstrap, and runs
# the compose stack.
need docker-compose docker-compose
need dockerd docker.io
need mmdebstrap mmdebstrap
# tests/gguf_files.py builds llama.cpp's quantizer from its source where ../shared/bin has none; the
# C++ kernels (worker/continuous/kernels.py: tests/test_decoder.py, test_weights.py, test_invariance.py
# and every worker) are built with g++ by torch, with the ninja wheel of requirements-worker.txt.
need cmake cmake
need g++ g++
# ... against Python.h, which Debian's python3 comes without (python3-dev has it, and python3-config).
need python3-config python3-dev
# tests/test_netns.py makes a switch and hosts of network namespaces with iproute2's `ip`.
need ip iproute2
# tests/test_redis_security.py makes the certificates of its TLS Redis with the openssl command.
need openssl openssl
exec .venv/bin/python -m pytest "$@"
