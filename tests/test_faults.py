"""The tests' fault injection (worker/faults.py): one clearly named variable, off without it, loud
about a typo, and nowhere among the settings a production start reads."""
from __future__ import annotations

import dataclasses

import pytest

from shared.settings import Settings
from worker.faults import ENV, Faults, as_env


def test_no_variable_no_faults():
    assert not Faults.from_env({})
    assert not Faults.from_env({ENV: "  "})
    # The old settings' variables are nothing now: only the one named for tests turns a fault on.
    assert not Faults.from_env({"STEP_DELAY_S": "5", "CRASH_ON_PROMPT": "1,2", "CLOCK_SKEW_S": "60"})


def test_as_env_round_trips():
    env = as_env(crash_on_prompt=[7, 7], step_delay_s=0.05, clock_skew_s=-600)
    faults = Faults.from_env(env)
    assert faults == Faults(crash_on_prompt=(7, 7), step_delay_s=0.05, clock_skew_s=-600.0) and faults
    assert faults.describe() == "crash_on_prompt=(7, 7), step_delay_s=0.05, clock_skew_s=-600.0"


@pytest.mark.parametrize("text", ["{", "[1]", '{"step_delay": 1}', '{"crash_on_prompt": ["x"]}'])
def test_a_typo_fails_loudly(text):
    with pytest.raises(ValueError):
        Faults.from_env({ENV: text})
    with pytest.raises(TypeError):
        as_env(step_delay=1)


def test_no_fault_is_a_setting():
    names = {f.name for f in dataclasses.fields(Settings)}
    assert not names & {f.name for f in dataclasses.fields(Faults)}
