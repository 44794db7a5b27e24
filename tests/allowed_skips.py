"""The skips CI accepts. Under CI (the environment variable CI=true, as .ci/run sets it), any other
skip is a failure (tests/conftest.py's hooks): every feature the project claims (the Docker images,
the netns hosts, the C++ kernels, the mid-stream kill, Sentinel, Cluster, Prometheus, TLS Redis) has
its tools installed by test.sh, so a skip there means a test that did not run by accident, not a
machine that cannot run it. On a developer's machine (no CI) a test may still skip, its reason printed.

Each entry: a regular expression searched for in the skip's reason, and a comment saying why CI may
skip it. Keep this list short; an entry is a claim that CI cannot check that thing at all.
"""
from __future__ import annotations

import os
import re

ALLOWED: list[tuple[str, str]] = [
    # The CI machines have no GPU (2 CPU cores). A test of a CUDA-only path says so with a reason
    # starting "needs a CUDA GPU"; none does today (the GPU compose file is checked as a file only).
    (r"^needs a CUDA GPU\b", "CI has no GPU"),
]


def in_ci(environ=os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def allowed(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern, _ in ALLOWED)


def refusal(reason: str) -> str:
    """The failure's message for a skip CI does not accept."""
    listed = "; ".join(f"{pattern!r} ({why})" for pattern, why in ALLOWED) or "none"
    return (f"skipped in CI (CI=true), and a skip here is a failure: {reason!r}. Only these reasons may "
            f"skip in CI (tests/allowed_skips.py): {listed}. Install what the test needs (test.sh) or "
            f"fix the test; unset CI to let it skip on a developer's machine.")
