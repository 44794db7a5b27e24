"""serve.py as its tests run it: in files of its own output, tagged so that whatever it started can
be found and killed afterwards, and checked to leave nothing behind.

Every serve.py run here carries a unique STORYTELLER_TEST_TAG in its environment, which its
children inherit: scanning /proc/*/environ for the tag finds every process it left behind,
whatever it is. Its tests (tests/test_serve.py, tests/test_serve_signals.py) import the `tag`
fixture from here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from serve import port_is_free
from tests.processes import ROOT, _env

READY_TIMEOUT_S = 120  # a worker of the tiny model is ready in a few seconds on an idle machine
EXIT_TIMEOUT_S = 60


@pytest.fixture
def tag():
    """A unique tag for this test's processes; any still running at the end are killed."""
    value = uuid.uuid4().hex
    yield value
    for pid in tagged(value):
        os.kill(pid, signal.SIGKILL)


def tagged(tag: str) -> list[int]:
    """Pids of the live processes whose environment carries the tag (zombies have none)."""
    needle = f"STORYTELLER_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


class Serve:
    """`python serve.py ...` with its output (and its children's) in files."""

    def __init__(self, tmp_path: Path, tag: str, args: list[str], **env):
        self.out, self.err = tmp_path / "serve.out", tmp_path / "serve.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen([sys.executable, "serve.py", *args], cwd=ROOT, stdout=out,
                                            stderr=err, env=_env(STORYTELLER_TEST_TAG=tag, **env))

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def last_error_line(self) -> str:
        lines = [line for line in self.err.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def wait_until_ready(self) -> None:
        give_up = time.monotonic() + READY_TIMEOUT_S
        while "Storyteller is ready at" not in self.out.read_text(errors="replace"):
            if self.process.poll() is not None:
                pytest.fail(f"serve.py exited ({self.process.returncode}) before it was ready:\n"
                            f"{self.output()[-4000:]}")
            if time.monotonic() > give_up:
                pytest.fail(f"serve.py not ready in {READY_TIMEOUT_S} s:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait(self) -> int:
        try:
            return self.process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve.py still running after {EXIT_TIMEOUT_S} s:\n{self.output()[-4000:]}")


def assert_nothing_left(tag: str, *ports: int) -> None:
    """No process of the tag alive (given a moment to be reaped), and every port free again."""
    give_up = time.monotonic() + 5
    while tagged(tag) and time.monotonic() < give_up:
        time.sleep(0.1)
    left = {pid: " ".join(cmdline(pid)) for pid in tagged(tag)}
    assert not left, f"processes left behind: {left}"
    for port in ports:  # a closed connection's end may take a moment to go
        while not port_is_free("127.0.0.1", port) and time.monotonic() < give_up + 5:
            time.sleep(0.1)
        assert port_is_free("127.0.0.1", port), f"port {port} still taken"
