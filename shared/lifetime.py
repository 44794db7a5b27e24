"""Children that die with their parent (Linux's parent-death signal), for serve.py's children and
the batch worker's forked job processes: none outlives the process that started it, even when that
one is killed outright (SIGKILL), which no handler of its own could see."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def die_with_parent(parent: int) -> None:
    """In a child (between fork and exec, or just forked): SIGKILL when its parent `parent` dies
    (Linux), even by SIGKILL.

    Linux sends it when the thread that forked the child exits: fork from a thread that lives as long
    as the parent does (its main thread)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl: nobody would send the signal
        os._exit(1)


def dies_with_parent():
    """subprocess.Popen's preexec_fn for a child that must not outlive this process."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def forks_die_with_parent() -> None:
    """Every process this one forks from now on (os.fork, as RQ's worker forks a job process: its
    "work horse") dies with it; so do their own forks, each with its own parent."""
    forking = {}  # the forking process's pid, read in it just before each fork: the child's parent

    def before() -> None:
        forking["pid"] = os.getpid()

    os.register_at_fork(before=before, after_in_child=lambda: die_with_parent(forking["pid"]))
