"""Faults the tests inject into a worker, and nothing else uses.

The reliability, clock, fair-sharing and cluster tests start real worker processes that must crash on
a given job, run slower than their hardware, or read a wall clock that is off. Those are not
settings: a setting is in `--help`, in the settings table and in every environment that sets its
variable, and a production worker must not meet one by accident. So they come in one variable whose
name says what it is, STORYTELLER_TEST_FAULTS, holding a JSON object (`as_env` writes it), and a
worker started with any logs a warning naming them. In process, a test hands `Faults(...)` to the
Worker directly.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Mapping, Optional

ENV = "STORYTELLER_TEST_FAULTS"


@dataclass(frozen=True)
class Faults:
    # A worker that takes a job whose prompt is exactly these token ids dies at once (SIGKILL), as a
    # job that crashes its worker would make it.
    crash_on_prompt: tuple[int, ...] = ()
    # Seconds a worker sleeps after each engine step, as if its hardware were that much slower.
    step_delay_s: float = 0.0
    # Seconds added to the worker's wall clock (clock.wall), as if its host's clock were that far off.
    clock_skew_s: float = 0.0

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Faults":
        """The faults STORYTELLER_TEST_FAULTS asks for; none without it. A ValueError for a value that
        is not a JSON object of these fields, so that a test's typo fails loudly, not silently."""
        text = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV}: not JSON ({exc})") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known:
            raise ValueError(f"{ENV}: expected a JSON object of {', '.join(sorted(known))}; got {text}")
        return cls(crash_on_prompt=tuple(int(t) for t in raw.get("crash_on_prompt", ())),
                   step_delay_s=float(raw.get("step_delay_s", 0.0)),
                   clock_skew_s=float(raw.get("clock_skew_s", 0.0)))

    def __bool__(self) -> bool:
        return self != Faults()

    def describe(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in asdict(self).items()
                         if value != getattr(Faults(), name))


def as_env(**faults) -> dict[str, str]:
    """The environment that gives a worker process these faults: {ENV: their JSON}."""
    Faults(**{name: tuple(value) if name == "crash_on_prompt" else value for name, value in faults.items()})
    return {ENV: json.dumps(faults)}
